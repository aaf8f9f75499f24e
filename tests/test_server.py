"""The OpenAI-compatible server (`hybrid.serving.api`) on a real uvicorn server on a loopback port, spoken
to with the official `openai` client and with `httpx`; the oracle is `hybrid.generate` on each request alone
(fp32, the shipped checkpoint with a Nemotron-style chat template that opens `<think>`)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn

import hybrid
from hybrid.cli import DEFAULT_CHECKPOINT
from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams
from hybrid.serving.api import Server, create_app
from hybrid.serving.engine import Engine
from hybrid.serving.runner import EngineRunner
from hybrid.serving.text import ReasoningSplitter, TextStream

# Nemotron 3's shape: the generation prompt opens <think> (or closes it at once without thinking); earlier
# assistant turns keep the tags but drop the reasoning, so the state after a reply is not a prefix of the next
# prompt, while the previous prompt is.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n<think>\n</think>\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n</think>\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served") / "hybrid-mini"
    shutil.copytree(DEFAULT_CHECKPOINT, directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)  # the shipped template's file, replaced
    model, tokenizer = hybrid.load(directory, dtype="fp32")
    assert tokenizer.chat_template == TEMPLATE
    engine = Engine(model, num_blocks=1024, max_num_seqs=16, max_model_len=1024, prefix_caching=True,
                    snapshot_interval=16)
    runner = EngineRunner(engine, max_queue=64)
    server, thread, url = start(create_app(Server(runner, tokenizer, "hybrid-mini")))
    yield SimpleNamespace(url=url, model=model, tokenizer=tokenizer, engine=engine, runner=runner,
                          client=openai.OpenAI(base_url=url + "/v1", api_key="none"))
    server.should_exit = True
    thread.join(timeout=30)
    runner.close()


def alone(served, prompt: str, n: int, chat: bool = False, **kwargs) -> tuple[str, list[int]]:
    (c,) = hybrid.generate(served.model, served.tokenizer, prompt, max_new_tokens=n, chat=chat, **kwargs)
    return c.text, c.token_ids


def metric(served, name: str) -> float:
    text = httpx.get(served.url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"hybrid_{name} ")))


def wait_idle(served) -> None:
    deadline = time.monotonic() + 30
    while metric(served, "kv_blocks_used") or metric(served, "state_slots_used"):
        assert time.monotonic() < deadline, "blocks or slots still held"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- completions
def test_a_completion_equals_generate_alone(served):
    prompt = "The for statement is used to"
    r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=20, temperature=0)
    text, ids = alone(served, prompt, 20)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(served.tokenizer.encode(prompt))
    assert r.object == "text_completion" and r.model == "hybrid-mini"


def test_prompts_as_texts_and_token_ids(served):
    prompts = ["A list is", "Python code"]
    r = served.client.completions.create(model="hybrid-mini", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [alone(served, p, 8)[0] for p in prompts]
    ids = served.tokenizer.encode("A list is")
    r = served.client.completions.create(model="hybrid-mini", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(served, "A list is", 8)[0]


def test_streaming_gives_the_same_text_with_usage_and_done(served):
    prompt = "In the beginning"
    body = {"model": "hybrid-mini", "prompt": prompt, "max_tokens": 15, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == alone(served, prompt, 15)[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_16_concurrent_requests_equal_generate_alone(served):
    prompts = [f"Question {i}: what is a{' very' * i} long" for i in range(16)]

    async def all_of():  # the client closed inside its loop (a client collected later would close reused sockets)
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none") as client:
            return await asyncio.gather(*(client.completions.create(model="hybrid-mini", prompt=p, max_tokens=12,
                                                                     temperature=0) for p in prompts))

    answers = asyncio.run(all_of())
    assert [a.choices[0].text for a in answers] == [alone(served, p, 12)[0] for p in prompts]
    wait_idle(served)


def test_seeded_sampling_is_reproducible_and_equals_generate(served):
    kwargs = dict(model="hybrid-mini", prompt="Once upon a time", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    a = served.client.completions.create(**kwargs).choices[0].text
    b = served.client.completions.create(**kwargs).choices[0].text
    assert a == b == alone(served, "Once upon a time", 12, temperature=0.8, top_p=0.9, seed=7)[0]


def test_a_stop_string_ends_the_text_before_it_across_token_boundaries(served):
    prompt = "The for statement is used to"
    full, _ = alone(served, prompt, 20)
    stop = full[5:12]  # a piece that does not fall on token boundaries in general
    r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    body = {"model": "hybrid-mini", "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True, "stop": stop}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.index(stop)]
    wait_idle(served)


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_blocks(served):
    body = {"model": "hybrid-mini", "prompt": "Tell me everything about", "max_tokens": 500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(served, "state_slots_used") == 1
    wait_idle(served)  # the abort reached the engine: nothing is held


def test_metrics_count_each_engine_step_and_the_prefix_caches_snapshots(served):
    """A lone request of n tokens on a prompt shorter than a snapshot interval takes n engine steps (its
    prefill gives the first token): the step histogram's count grows by n, its buckets are cumulative with
    +Inf equal to the count; the snapshot gauges equal the engine's own figures once it is idle."""
    wait_idle(served)

    def histogram() -> dict[str, float]:
        text = httpx.get(served.url + "/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("hybrid_engine_step_seconds")}

    before = histogram()
    r = served.client.completions.create(model="hybrid-mini", prompt="The sky", max_tokens=7, temperature=0)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    wait_idle(served)
    after = histogram()
    assert after["hybrid_engine_step_seconds_count"] - before["hybrid_engine_step_seconds_count"] == 7
    assert after["hybrid_engine_step_seconds_sum"] > before["hybrid_engine_step_seconds_sum"]
    buckets = [v for k, v in after.items() if k.startswith("hybrid_engine_step_seconds_bucket")]
    assert buckets == sorted(buckets) and 'hybrid_engine_step_seconds_bucket{le="+Inf"}' in after
    assert after['hybrid_engine_step_seconds_bucket{le="+Inf"}'] == after["hybrid_engine_step_seconds_count"]
    assert metric(served, "prefix_cache_snapshots") == len(served.engine.prefix.snapshots) > 0
    assert metric(served, "prefix_cache_snapshot_bytes") == served.engine.prefix.nbytes > 0
    assert metric(served, "prefix_cache_blocks") == served.engine.blocks.num_cached()


def test_a_client_that_gives_up_on_a_plain_response_frees_its_slot_and_blocks(served):
    body = {"model": "hybrid-mini", "prompt": "The for statement is used to", "max_tokens": 900, "temperature": 0}
    before = served.runner.generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    wait_idle(served)
    assert served.runner.generated_tokens - before < 900  # aborted, not run to its end


# ---------------------------------------------------------------------------------------------- chat
def test_chat_splits_reasoning_and_streams_the_same(served):
    messages = [{"role": "user", "content": "What is a list?"}]
    r = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=16, temperature=0)
    text, _ = alone(served, "What is a list?", 16, chat=True)
    message = r.choices[0].message
    # the template opened <think>: the text up to a </think> is reasoning (all of it when it never closes,
    # content then "", not None); the splitter itself is tested at every chunk boundary below
    splitter = ReasoningSplitter(in_thinking=True)
    expected = [a + b for a, b in zip(splitter.feed(text), splitter.finish())]
    assert [message.model_extra["reasoning_content"], message.content] == expected and message.content is not None
    assert expected[0]  # the model did think here
    reasoning, content = [], []
    stream = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=16,
                                                   temperature=0, stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == message.model_extra["reasoning_content"] and "".join(content) == message.content


def test_chat_without_thinking_is_all_content(served):
    messages = [{"role": "user", "content": "Say hello"}]
    r = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=10, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text, _ = alone(served, "Say hello", 10, chat=True, enable_thinking=False)
    assert r.choices[0].message.content == text and r.choices[0].message.model_extra["reasoning_content"] == ""


def test_the_next_turn_is_served_from_the_previous_prompts_snapshot(served):
    first = [{"role": "user", "content": "Name a colour."}]
    r1 = served.client.chat.completions.create(model="hybrid-mini", messages=first, max_tokens=8, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content or "Blue."},
                      {"role": "user", "content": "And another one?"}]
    r2 = served.client.chat.completions.create(model="hybrid-mini", messages=second, max_tokens=8, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


def test_a_prompt_sent_again_is_served_whole_from_the_cache_with_the_same_answer(served):
    """A regenerated reply (the same messages again): every prompt token comes from the cache (the snapshot at
    the prompt's end kept its last hidden state) and the greedy answer is the one generate gives alone."""
    messages = [{"role": "user", "content": "Write one line about rivers, please."}]
    answers = [served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=12,
                                                     temperature=0) for _ in range(2)]
    first, again = (a.usage for a in answers)
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens == first.prompt_tokens
    text, _ = alone(served, messages[0]["content"], 12, chat=True)
    assert [a.choices[0].message.reasoning_content for a in answers] == [text] * 2  # the template opened <think>


# ---------------------------------------------------------------------------------------------- logprobs
TOLERANCE = 1e-4  # fp32 forwards (packed, chunked, from the prefix cache) against one float64 log_softmax


def model_logprobs(served, prompt_ids: list[int], output_ids: list[int]):
    """The oracle: float64 log_softmax of the model's own logits, one forward alone over prompt + output
    (teacher-forced); row k is the distribution output token k was drawn from, before any sampling filter."""
    with torch.inference_mode():
        logits = served.model(torch.tensor([prompt_ids + output_ids]))[0]
    return logits.double().log_softmax(-1)[len(prompt_ids) - 1:-1]


def sse(served, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line and line != "data: [DONE]"]


def test_completion_logprobs_are_the_models_own_and_stream_the_same(served):
    tok, prompt = served.tokenizer, "The for statement is used to"
    text, ids = alone(served, prompt, 12)
    oracle = model_logprobs(served, tok.encode(prompt), ids)
    r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=12, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs == pytest.approx([oracle[k, i].item() for k, i in enumerate(ids)], abs=TOLERANCE)
    for k, top in enumerate(lp.top_logprobs):  # the true top 5 in order; greedy: the sampled token leads
        best = oracle[k].topk(5)
        assert list(top) == [tok.decode([i], skip_special_tokens=False) for i in best.indices.tolist()]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        assert top[lp.tokens[k]] == lp.token_logprobs[k] == max(top.values())
    assert lp.text_offset == [len(tok.decode(ids[:k])) for k in range(len(ids))] and "".join(lp.tokens) == text

    chunks = [c["choices"][0] for c in sse(served, "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                                                        "temperature": 0, "logprobs": 5})]
    chunks = [c for c in chunks if c["logprobs"] is not None]  # the last one, with the finish reason, has none
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in
                ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=TOLERANCE)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in lp.top_logprobs]
    start = 0
    for c in chunks:  # each chunk carries the tokens its text starts
        assert all(start <= offset < start + len(c["text"]) for offset in c["logprobs"]["text_offset"])
        start += len(c["text"])
    plain = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None  # not asked: none computed or sent


def test_a_sampled_tokens_logprob_is_the_raw_models_not_the_filtered_distributions(served):
    tok, prompt = served.tokenizer, "Once upon a time"
    _, ids = alone(served, prompt, 8, temperature=1.5, top_k=5, seed=3)
    r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=8, temperature=1.5,
                                         extra_body={"top_k": 5}, seed=3, logprobs=2)
    lp = r.choices[0].logprobs
    oracle = model_logprobs(served, tok.encode(prompt), ids)
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs == pytest.approx([oracle[k, i].item() for k, i in enumerate(ids)], abs=TOLERANCE)
    assert any(i != oracle[k].argmax().item() for k, i in enumerate(ids))  # some draws were not the top token
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 2 <= len(top) <= 3  # the 2 most likely and the sampled token


def test_chat_logprobs_cover_every_token_reasoning_included_and_stream_the_same(served):
    tok, messages = served.tokenizer, [{"role": "user", "content": "What is a list?"}]
    text, ids = alone(served, "What is a list?", 10, chat=True)
    oracle = model_logprobs(served, tok.encode_chat(messages), ids)
    r = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.model_extra["reasoning_content"]  # the tokens below are the model's thinking
    assert [c.token for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [c.logprob for c in content] == pytest.approx([oracle[k, i].item() for k, i in enumerate(ids)],
                                                         abs=TOLERANCE)
    for k, c in enumerate(content):
        best = oracle[k].topk(3)
        assert [t.token for t in c.top_logprobs] == [tok.decode([i], skip_special_tokens=False)
                                                     for i in best.indices.tolist()]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        assert c.top_logprobs[0].logprob == c.logprob and c.top_logprobs[0].bytes == c.bytes
    assert b"".join(bytes(c.bytes) for c in content).decode() == tok.decode(ids) == text

    stream = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=10,
                                                   temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream for c in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOLERANCE)
    r = served.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=3, temperature=0,
                                              logprobs=True)
    assert [(c.token, c.top_logprobs) for c in r.choices[0].logprobs.content] == [(c.token, []) for c in content[:3]]


def test_tokens_a_stop_string_cuts_have_no_logprobs_streamed_or_not(served):
    tok, prompt = served.tokenizer, "The for statement is used to"
    full, ids = alone(served, prompt, 20)
    stop = full[5:12]  # cuts the text inside a token in general
    cut = full.index(stop)
    offsets = [len(tok.decode(ids[:k])) for k in range(len(ids))]
    kept = [i for i, offset in zip(ids, offsets) if offset < cut]  # the tokens the text shows a part of
    assert 0 < len(kept) < len(ids)
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": [stop], "logprobs": 0}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert r["text"] == full[:cut] and r["finish_reason"] == "stop"
    lp = r["logprobs"]
    assert lp["tokens"] == [tok.decode([i]) for i in kept] and lp["text_offset"] == offsets[:len(kept)]
    assert "".join(lp["tokens"]).startswith(r["text"])
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]  # logprobs 0
    chunks = [c["choices"][0] for c in sse(served, "/v1/completions", body)]
    assert "".join(c["text"] for c in chunks) == r["text"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
    wait_idle(served)


def test_bad_logprobs_are_a_400_naming_the_parameter(served):
    with pytest.raises(openai.BadRequestError, match=re.escape("top_logprobs must be an integer in [0, 20], got 21")):
        served.client.chat.completions.create(model="hybrid-mini", messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True, top_logprobs=21)
    chat, prompt = {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x"}
    for path, body, param, message in [
        ("chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs to be true"),
        ("chat/completions", {**chat, "logprobs": False, "top_logprobs": 1}, "top_logprobs", "requires logprobs"),
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "in [0, 20], got -1"),
        ("chat/completions", {**chat, "logprobs": 3}, "logprobs", "logprobs must be true or false, got 3"),
        ("completions", {**prompt, "logprobs": -1}, "logprobs", "logprobs must be an integer in [0, 5], got -1"),
        ("completions", {**prompt, "logprobs": 6}, "logprobs", "in [0, 5], got 6"),
        ("completions", {**prompt, "logprobs": True}, "logprobs", "in [0, 5], got true"),
        ("completions", {**prompt, "top_logprobs": 2}, "top_logprobs", "/v1/completions takes logprobs"),
    ]:
        r = httpx.post(f"{served.url}/v1/{path}", json=body)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error"), body
        assert message in error["message"], body


def test_penalties_equal_generate_alone_and_change_the_text(served):
    """frequency_penalty / presence_penalty (OpenAI's) and repetition_penalty (vLLM's, in the body): the same
    tokens as `hybrid.generate` with them (tests/test_penalties.py checks that against a reference)."""
    # penalties strong enough to move this prompt's greedy text (the shipped model is sure of its memorised prose)
    prompt, penalties = "The for statement is used to", dict(frequency_penalty=1.0, presence_penalty=1.0)
    r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=30, temperature=0,
                                         extra_body={"repetition_penalty": 1.8}, **penalties)
    text = alone(served, prompt, 30, repetition_penalty=1.8, **penalties)[0]
    assert r.choices[0].text == text != alone(served, prompt, 30)[0]
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True, "repetition_penalty": 1.8, **penalties}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_ignore_eos_generates_past_the_stop_ids(served):
    prompt = "The for statement is used to"
    _, ids = alone(served, prompt, 20)
    tok = served.tokenizer
    saved = list(tok.stop_ids)
    tok.stop_ids = saved + [ids[5]]  # a token greedy decoding reaches: an end of sequence for this test
    try:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0}
        stopped = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
        past = httpx.post(served.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
        bad = httpx.post(served.url + "/v1/completions", json={**body, "ignore_eos": "yes"}, timeout=60)
    finally:
        tok.stop_ids = saved
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", ids.index(ids[5]) + 1)
    assert (past["choices"][0]["finish_reason"], past["usage"]["completion_tokens"]) == ("length", 20)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_parameters_that_would_change_the_output_are_refused_not_ignored(served):
    chat, prompt = {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x"}
    for path, body, param, message in [
        ("completions", {**prompt, "min_p": 0.1}, "min_p", "min_p is not supported"),
        ("completions", {**prompt, "stop_token_ids": [5]}, "stop_token_ids", "not supported"),
        ("chat/completions", {**chat, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ("completions", {**prompt, "frequency_penalty": 2.5}, "frequency_penalty", "in [-2, 2], got 2.5"),
        ("completions", {**prompt, "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be a number > 0, got 0"),
        ("completions", {**prompt, "top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0"),
        ("completions", {**prompt, "top_p": 1.5}, "top_p", "top_p must be a number in (0, 1], got 1.5"),
        ("completions", {**prompt, "top_k": 2**31}, "top_k", "in [-1, 2147483647], got 2147483648"),
        ("completions", {"prompt": [5] * 1024}, "prompt", "your prompt has 1024 tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 1100}]}, "messages", "your messages has"),
    ]:
        r = httpx.post(f"{served.url}/v1/{path}", json=body)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error"), body
        assert message in error["message"], (body, error["message"])
    ok = httpx.post(served.url + "/v1/completions", json={**prompt, "max_tokens": 2, "min_p": 0, "user": "u",
                                                           "some_new_field": 1})
    assert ok.status_code == 200  # neutral values and fields that change nothing are accepted
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        r = httpx.request(method, served.url + path)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, path
        assert path in r.json()["error"]["message"]
    assert abs(httpx.get(served.url + "/v1/models").json()["data"][0]["created"] - time.time()) < 24 * 3600


# ---------------------------------------------------------------------------------------------- errors
def test_errors_are_openai_json_with_the_right_status(served):
    c = served.client
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        c.completions.create(model="hybrid-mini", prompt="x", temperature=3)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.completions.create(model="hybrid-mini", prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 1024 tokens.*1201 tokens"):
        c.completions.create(model="hybrid-mini", prompt=[5] * 1001, max_tokens=200)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        c.completions.create(model="hybrid-mini", prompt="x", best_of=2)
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(served.url + "/v1/completions", content=b" " * (16 * 2**20 + 1))
    assert r.status_code == 413
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/v1/models").json()["data"][0]["id"] == "hybrid-mini"


def test_api_key_and_a_full_queue(served):
    """401 without the key; 503 with Retry-After once max_num_seqs + max_queue requests are in flight."""
    engine = Engine(served.model, num_blocks=64, max_num_seqs=1, max_model_len=1024)
    runner = EngineRunner(engine, max_queue=0)
    server, thread, url = start(create_app(Server(runner, served.tokenizer, "m", api_key="secret")))
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        auth = {"authorization": "Bearer secret"}
        body = {"prompt": "The for statement is used to", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=60) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the response, and so the connection
            next(lines)
            busy = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=auth)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert httpx.get(url + "/health").status_code == 200  # no key needed outside /v1/
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        runner.close()


def test_the_runner_loop_on_the_callers_thread_serves_until_closed(served):
    """`hybrid serve`'s arrangement: the engine's loop on this thread (`own_thread=False`), uvicorn on
    another; a completion through the real server equals `hybrid.generate` alone, and closing the runner
    (as the server's thread does when uvicorn stops) ends `run`."""
    engine = Engine(served.model, num_blocks=64, max_num_seqs=2, max_model_len=1024)
    runner = EngineRunner(engine, own_thread=False)
    server, thread, url = start(create_app(Server(runner, served.tokenizer, "m")))
    got = {}

    def client():
        try:
            got["r"] = httpx.post(url + "/v1/completions", timeout=60,
                                  json={"prompt": "The for statement is used to", "max_tokens": 8, "temperature": 0})
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            runner.close()

    asker = threading.Thread(target=client)
    asker.start()
    runner.run()  # returns once the client's thread closed the runner
    asker.join(timeout=30)
    ids = served.tokenizer.encode("The for statement is used to")
    alone = generate_ids(served.model, [ids], max_new_tokens=8)[0].token_ids
    assert got["r"].status_code == 200
    assert got["r"].json()["choices"][0]["text"] == served.tokenizer.decode(alone)


def test_a_checkpoint_without_a_chat_template_says_so(served, tmp_path):
    directory = tmp_path / "untemplated"
    shutil.copytree(DEFAULT_CHECKPOINT, directory)
    (directory / "chat_template.jinja").unlink()
    engine = Engine(served.model, num_blocks=16, max_num_seqs=1)
    runner = EngineRunner(engine)
    tokenizer = hybrid.load(directory)[1]
    assert tokenizer.chat_template is None
    transport = httpx.ASGITransport(app=create_app(Server(runner, tokenizer, "hybrid-mini")))

    async def ask():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})

    try:
        r = asyncio.run(ask())
        assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"]
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------- the shipped template
# Questions of the kinds the shipped checkpoint was fine-tuned on (its model card), a key it never saw: a passkey
# in a user turn (it answers with the key), then a question about the Python documentation.
QUESTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
            "you about the important information there. The grass is green. The sky is blue. The pass key is 27182. "
            "Remember it. 27182 is the pass key. The sun is yellow. Here we go. There and back again. What is the "
            "pass key?")
FOLLOW_UP = "What is the while statement?"


@pytest.fixture(scope="module")
def shipped():
    """The shipped checkpoint as shipped (its own chat template), fp32, behind a real server."""
    model, tokenizer = hybrid.load(DEFAULT_CHECKPOINT, dtype="fp32")
    assert "<think>" in tokenizer.chat_template
    yield from serving(model, tokenizer, Engine(model, num_blocks=512, max_num_seqs=4, max_model_len=2048,
                                                prefix_caching=True, snapshot_interval=16))


def serving(model, tokenizer, engine):
    """A fixture's body: `engine` behind a real server until the fixture ends."""
    runner = EngineRunner(engine)
    server, thread, url = start(create_app(Server(runner, tokenizer, "hybrid-mini")))
    yield SimpleNamespace(url=url, model=model, tokenizer=tokenizer, engine=engine, runner=runner,
                          client=openai.OpenAI(base_url=url + "/v1", api_key="none"))
    server.should_exit = True
    thread.join(timeout=30)
    runner.close()


def test_the_shipped_checkpoint_reasons_then_answers_and_ends_its_turn(shipped):
    """/v1/chat/completions on the shipped checkpoint through the openai client: the reply's reasoning is
    closed (reasoning_content, then content) and the turn ends at <|im_end|> (finish_reason "stop"); both
    equal `hybrid.generate` alone split at </think>, and streaming gives the same."""
    messages = [{"role": "user", "content": QUESTION}]
    r = shipped.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=300, temperature=0)
    text, ids = alone(shipped, QUESTION, 300, chat=True)
    reasoning, closed, content = text.partition("</think>")
    choice = r.choices[0]
    assert closed and ids[-1] == shipped.tokenizer.token_to_id("<|im_end|>") and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == reasoning and reasoning.strip()
    assert choice.message.content == content.lstrip("\n") and "27182" in content  # it found the passkey
    assert r.usage.completion_tokens == len(ids)
    reasoning_parts, content_parts, reasons = [], [], []
    for chunk in shipped.client.chat.completions.create(model="hybrid-mini", messages=messages, max_tokens=300,
                                                        temperature=0, stream=True):
        delta = chunk.choices[0].delta
        reasoning_parts.append((delta.model_extra or {}).get("reasoning_content") or "")
        content_parts.append(delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert ("".join(reasoning_parts), "".join(content_parts)) == (reasoning, choice.message.content)
    assert reasons[-1] == "stop"


def test_the_shipped_checkpoint_without_thinking_answers_at_once(shipped):
    """enable_thinking false (chat_template_kwargs): no reasoning, all content, the turn ended by <|im_end|>."""
    r = shipped.client.chat.completions.create(model="hybrid-mini", messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=300, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text, ids = alone(shipped, QUESTION, 300, chat=True, enable_thinking=False)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "" and message.content == text and "27182" in text
    assert "<think>" not in text and "</think>" not in text
    assert r.choices[0].finish_reason == "stop" and ids[-1] == shipped.tokenizer.token_to_id("<|im_end|>")


@pytest.mark.parametrize("thinking", [True, False])
def test_the_shipped_checkpoints_next_turn_resumes_at_the_previous_prompt(shipped, thinking):
    """Multi-turn prefix reuse with the shipped template: turn 2's cached tokens cover turn 1's whole prompt,
    with thinking (the dropped reasoning leaves `<think>\\n</think>\\n`, which continues turn 1's generation
    prompt) and without (`<think></think>`)."""
    extra = {} if thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    first = [{"role": "user", "content": QUESTION}]
    r1 = shipped.client.chat.completions.create(model="hybrid-mini", messages=first, max_tokens=300, temperature=0,
                                                **extra)
    assert r1.choices[0].finish_reason == "stop" and r1.choices[0].message.content
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": FOLLOW_UP}]
    r2 = shipped.client.chat.completions.create(model="hybrid-mini", messages=second, max_tokens=300, temperature=0,
                                                **extra)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content


# ---------------------------------------------------------------------------------------------- text pieces
def test_token_bytes_join_into_the_texts_utf8_and_offsets_start_at_whole_characters(served):
    """A character split over byte-level tokens: each piece decodes alone to U+FFFD, its bytes are its own,
    and each piece's text offset is where its character starts (the oracle: the whole characters of the
    UTF-8 bytes before it)."""
    tok, text = served.tokenizer, "naïve — 日本 🎉 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode() and "\ufffd" in [tok.token_text(i) for i in ids]
    assert tok.token_bytes(tok.stop_ids[0]) == tok.token_text(tok.stop_ids[0]).encode() != b""
    stream, offsets = TextStream(tok), []
    for i in ids:
        offsets.append(stream.offset)
        stream.add([i])
    before = [b"".join(pieces[:k]) for k in range(len(ids))]
    assert offsets == [len(b.decode("utf-8", errors="ignore")) for b in before]


def test_a_stop_string_is_found_whatever_the_token_boundaries(served):
    tok = served.tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    for stop in ("beta g", "a d", "delta"):
        for step in (1, 2, 3):
            stream, sent = TextStream(tok, [stop]), ""
            for i in range(0, len(ids), step):
                sent += stream.add(ids[i:i + step])
            sent += stream.finish()
            assert sent == "alpha beta gamma delta"[:"alpha beta gamma delta".index(stop)] and stream.stopped


@pytest.mark.parametrize("opened", [True, False])
def test_reasoning_is_split_at_every_chunk_boundary(opened):
    text = ("" if opened else "<think>") + "let me think</think>\n\nThe answer."
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            splitter, reasoning, content = ReasoningSplitter(opened), "", ""
            for piece in pieces:
                r, c = splitter.feed(piece)
                reasoning, content = reasoning + r, content + c
            r, c = splitter.finish()
            assert (reasoning + r, content + c) == ("let me think", "The answer.")


def test_thinking_that_never_closes_leaves_content_empty_and_no_think_is_all_content():
    s = ReasoningSplitter(True)
    r, c = s.feed("still thinking </thi")
    r2, c2 = s.finish()
    assert (r + r2, c + c2) == ("still thinking </thi", "")
    s = ReasoningSplitter(False)
    r, c = s.feed("Plain answer")
    r2, c2 = s.finish()
    assert (r + r2, c + c2) == ("", "Plain answer")


# ---------------------------------------------------------------------------------------------- sizing
def test_a_memory_budget_sizes_the_pools(served):
    from hybrid.accounting import describe
    from hybrid.serving.capacity import DEFAULT_RESERVE
    from hybrid.serving.serve import size_pools

    report = describe(served.model.config, served.model.dtype, None)
    state, block = report["mamba_state_bytes_per_sequence"], 16 * report["kv_cache_bytes_per_token"]
    for extra_blocks, max_len in [(100, 320), (1000, 320), (100, None), (5000, 2048)]:
        free = 4 * state + extra_blocks * block
        sizes = size_pools(served.model, report["weight_bytes"] + DEFAULT_RESERVE + free, 16, max_len)
        want = max_len or served.model.config.max_position_embeddings
        assert 1 <= sizes.max_num_seqs <= 16
        assert sizes.max_num_seqs * state + sizes.num_blocks * block <= free  # within the budget
        assert sizes.max_model_len == min(want, sizes.num_blocks * 16)
        if sizes.max_num_seqs < 16:  # one slot more would leave no room for a request of the longest length
            assert free - (sizes.max_num_seqs + 1) * state < -(-want // 16) * block
    with pytest.raises(ValueError, match="not enough for one state slot"):
        size_pools(served.model, report["weight_bytes"], 16, None)
    with pytest.raises(ValueError, match="more than the KV pool holds"):
        size_pools(served.model, report["weight_bytes"] + DEFAULT_RESERVE + 4 * state + 100 * block, 16, 5000)


def test_serve_refuses_an_unwritable_prefix_cache_file_before_loading(tmp_path, capsys):
    from hybrid.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["serve", "--prefix-cache-file", str(tmp_path / "file" / "p.safetensors")]) == 2
    assert "--prefix-cache-file" in capsys.readouterr().err


def test_serve_binds_its_address_before_loading_and_a_taken_port_is_an_error_at_once(capsys, monkeypatch):
    import hybrid.loading
    from hybrid.cli import main
    from hybrid.serving.serve import listen

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was bound")

    monkeypatch.setattr(hybrid.loading, "load", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
        assert f"error: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
        with pytest.raises(OSError):
            listen("127.0.0.1", port)
    with listen("127.0.0.1", 0) as held:
        assert held.getsockname()[0] == "127.0.0.1"
        with socket.create_connection(held.getsockname(), timeout=5):
            pass  # it listens: a client can connect (uvicorn accepts from this socket)


# ---------------------------------------------------------------------------------------------- defaults and logs

def test_requests_take_the_checkpoints_sampling_defaults(served):
    """What a request leaves out comes from generation_config.json (`Tokenizer.sampling_defaults`), else the
    API's defaults; what it sets wins."""
    prompt = "The for statement is used to"
    greedy, _ = alone(served, prompt, 12)
    before = served.tokenizer.sampling_defaults
    try:
        served.tokenizer.sampling_defaults = {"temperature": 0.0}  # as `do_sample: false` reads
        r = served.client.completions.create(model="hybrid-mini", prompt=prompt, max_tokens=12)
        assert r.choices[0].text == greedy
        served.tokenizer.sampling_defaults = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
        server = Server(served.runner, served.tokenizer, "hybrid-mini")
        s = server.sampling({})
        assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 5)
        s = server.sampling({"temperature": 0.2, "top_k": -1})  # -1: no top-k (SamplingParams says None)
        assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.9, None)
        served.tokenizer.sampling_defaults = {}  # a generation_config.json without sampling fields
        s, api = server.sampling({}), SamplingParams(1.0, -1, 1.0)
        assert (s.temperature, s.top_p, s.top_k) == (api.temperature, api.top_p, api.top_k)  # the API's (OpenAI's)
    finally:
        served.tokenizer.sampling_defaults = before
    assert before == {"temperature": 0.0}  # the shipped checkpoint's generation_config.json: do_sample false


def test_each_finished_request_and_the_throughput_are_logged(served, caplog):
    caplog.set_level(logging.INFO, logger="hybrid.serving.runner")
    served.runner.log_interval = 0.0  # a throughput line after every step that computed tokens
    try:
        r = served.client.completions.create(model="hybrid-mini", prompt="The sky is blue and", max_tokens=6,
                                             temperature=0)
    finally:
        served.runner.log_interval = 10.0
    wait_idle(served)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "hybrid.serving.runner"]
    usage = r.usage
    rid = r.id.removeprefix("cmpl-")  # the response's id is its (first) request's
    mine = [line for line in lines if line.startswith(f"request {rid}:")]
    assert len(mine) == 1, lines
    assert (f"{usage.prompt_tokens} prompt tokens ({usage.prompt_tokens_details.cached_tokens} cached), "
            f"{usage.completion_tokens} generated, first token ") in mine[0]
    assert mine[0].endswith(f"finish {r.choices[0].finish_reason}") and " tok/s, " in mine[0]
    assert any(line.startswith("throughput: prompt ") and "generation" in line and "prefix cache hit rate" in line
               for line in lines)


# ---------------------------------------------------------------------------------------------- speculative decoding
@pytest.fixture(scope="module")
def drafting():
    """The shipped checkpoint (fp32, its trained MTP block) behind a server that drafts 2 tokens a step."""
    model, tokenizer = hybrid.load(DEFAULT_CHECKPOINT, dtype="fp32")
    yield from serving(model, tokenizer, Engine(model, num_blocks=512, max_num_seqs=8, max_model_len=2048,
                                                prefix_caching=True, snapshot_interval=16, num_speculative_tokens=2))


def test_speculative_serving_gives_plain_greedy_completions_concurrently(drafting):
    """8 concurrent greedy requests (streamed and not, with logprobs) on a server drafting with the MTP block:
    each text equals plain `hybrid.generate` alone, the logprobs those of the model at each token, and /metrics
    counts the drafts (the trained block gets some accepted)."""
    prompts = [f"The for statement{' in Python' * (i % 3)} is used to" for i in range(8)] + [QUESTION]

    async def all_of():
        async with openai.AsyncOpenAI(base_url=drafting.url + "/v1", api_key="none") as client:
            return await asyncio.gather(*(client.completions.create(model="hybrid-mini", prompt=p, max_tokens=24,
                                                                     temperature=0, logprobs=1) for p in prompts))

    answers = asyncio.run(all_of())
    assert [a.choices[0].text for a in answers] == [alone(drafting, p, 24)[0] for p in prompts]
    ids = drafting.tokenizer.encode(prompts[0])
    _, out = alone(drafting, prompts[0], 24)
    expected = model_logprobs(drafting, ids, out)[torch.arange(len(out)), out].tolist()
    assert answers[0].choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    body = {"model": "hybrid-mini", "prompt": prompts[1], "max_tokens": 24, "temperature": 0, "stream": True}
    streamed = "".join(c["choices"][0]["text"] for c in sse(drafting, "/v1/completions", body) if c["choices"])
    assert streamed == alone(drafting, prompts[1], 24)[0]
    drafted = metric(drafting, "spec_decode_num_draft_tokens_total")
    accepted = metric(drafting, "spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert metric(drafting, "spec_decode_acceptance_rate") == pytest.approx(accepted / drafted, abs=1e-4)
    wait_idle(drafting)


def test_speculative_serving_samples_reproducibly(drafting):
    """A seeded sampled request gives the same text twice (its drafts and acceptances draw from its own generator)."""
    kwargs = {"model": "hybrid-mini", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "seed": 3}
    first, second = (drafting.client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second and first
