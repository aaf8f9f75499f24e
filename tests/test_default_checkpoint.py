"""The shipped default checkpoint (checkpoints/hybrid-mini): published layout, every part of the architecture,
the reference implementation's logits and greedy tokens (a plain prompt and a chat), passkey retrieval at its
training length, its chat tokens, and its chat template against independent renderings (transformers'
`apply_chat_template` on the same files, and the Nemotron 3 format written out by hand)."""

import json
from pathlib import Path

import pytest
import torch

import hybrid
from hybrid.eval.tasks import fit_to_length
from hybrid.generate import generate_ids

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "hybrid-mini"
TRAIN_LENGTH = 256
GREEDY = Path(__file__).resolve().parent / "data" / "hybrid_mini_greedy.json"


@pytest.fixture(scope="module")
def loaded():
    return hybrid.load(CKPT)


def test_layout_size_and_architecture(loaded):
    model, _ = loaded
    files = {p.name for p in CKPT.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "README.md", "training_log.json", "chat_template.jinja",
            "finetune_log.json"} <= files
    assert sum(p.stat().st_size for p in CKPT.iterdir()) <= 50 * 2**20
    config = json.loads((CKPT / "config.json").read_text())
    pattern = config["hybrid_override_pattern"]
    assert {"M", "*", "E"} <= set(pattern) and pattern.count("*") < pattern.count("M")
    assert config["n_routed_experts"] > config["num_experts_per_tok"] >= 2 and config["n_shared_experts"] == 1
    assert model.mtp is not None and config["num_nextn_predict_layers"] == 1
    assert model.dtype == torch.bfloat16


def transformers_greedy(prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' NemotronHForCausalLM on the same files, fp32: (n greedy tokens, prompt logits); the
    greedy loop stops early at a stop id of generation_config.json (the end of a chat turn)."""
    from transformers import NemotronHForCausalLM

    # time_step_min=0.0: see test_train.py (transformers clamps dt at an initialisation setting)
    theirs = NemotronHForCausalLM.from_pretrained(CKPT, dtype=torch.float32, time_step_min=0.0).eval()
    stops = theirs.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    ids = list(prompt_ids)
    with torch.no_grad():
        logits = theirs(torch.tensor([ids])).logits
        for _ in range(n):  # full forward per token: no cache or generation settings between us and the model
            ids.append(int(theirs(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stops:
                break
    return ids[len(prompt_ids):], logits


def transformers_chat_ids(messages: list[dict], **kwargs) -> list[int]:
    """The chat's prompt ids as transformers' tokenizer renders and encodes it from the checkpoint's files."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(CKPT).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                  return_dict=False, **kwargs)
    return list(ids)


@pytest.mark.parametrize("case", ["plain", "chat"])
def test_stored_greedy_continuation_is_transformers_and_ours(case):
    """tests/data/hybrid_mini_greedy.json holds a fixed prompt and a fixed chat (prompt ids from transformers'
    tokenizer and the shipped template) with the greedy tokens transformers produced from these files (fp32);
    it still does, and our tokenizer, template and model produce the same ids, tokens and logits."""
    stored = json.loads(GREEDY.read_text())
    if case == "chat":
        stored = stored["chat"]
        assert transformers_chat_ids(stored["messages"]) == stored["prompt_ids"]
        _, tok = hybrid.load(CKPT, dtype="fp32")
        assert tok.encode_chat(stored["messages"]) == stored["prompt_ids"]
    theirs, ref_logits = transformers_greedy(stored["prompt_ids"], len(stored["greedy_ids"]))
    assert theirs == stored["greedy_ids"]
    ours, tok = hybrid.load(CKPT, dtype="fp32")
    with torch.no_grad():
        assert (ours(torch.tensor([stored["prompt_ids"]])) - ref_logits).abs().max() < 1e-3
    (c,) = generate_ids(ours, [stored["prompt_ids"]], max_new_tokens=len(stored["greedy_ids"]), stop_ids=tok.stop_ids)
    assert c.token_ids == stored["greedy_ids"]
    if case == "chat":  # the model closes its thinking and ends its turn
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.token_to_id("<|im_end|>")
        assert "</think>" in tok.decode(c.token_ids)


@pytest.mark.parametrize("depth", [0.0, 25.0, 50.0, 75.0, 100.0])
def test_passkey_at_training_length(loaded, depth):
    """Unseen passkeys (seeds the training stream never drew) at five depths of a 496-token prompt."""
    model, tok = loaded
    for seed in (9001, 9002):
        s = fit_to_length("passkey", tok, TRAIN_LENGTH - 16, seed, depth_percent=depth)
        (c,) = generate_ids(model, [tok.encode(s.prompt)], max_new_tokens=8)
        assert tok.decode(c.token_ids).strip().startswith(s.continuation.strip()), (depth, seed, tok.decode(c.token_ids))


# ---------------------------------------------------------------------------------------------- chat
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"]


def test_chat_tokens_are_one_id_each_and_the_end_of_a_turn_stops(loaded):
    """Nemotron 3's chat tokens are added tokens past the trained vocabulary (padded to a multiple of 64), never
    split; `<|im_end|>` is the tokenizer's eos and a stop id beside config.json's eos 2; the ChatML markers are
    special (dropped from decoded text), the think and tool tags are not (the reasoning split and tool-call
    parsers read them in the text)."""
    model, tok = loaded
    config = json.loads((CKPT / "config.json").read_text())
    generation = json.loads((CKPT / "generation_config.json").read_text())
    ids = [tok.token_to_id(t) for t in CHAT_TOKENS]
    assert ids == list(range(4096, 4104))
    assert config["vocab_size"] == model.config.vocab_size == 4160 and config["vocab_size"] % 64 == 0
    for token, i in zip(CHAT_TOKENS, ids):
        assert tok.encode(f"x{token}y", add_special_tokens=False) == \
            tok.encode("x", add_special_tokens=False) + [i] + tok.encode("y", add_special_tokens=False)
    assert config["eos_token_id"] == 2 and generation["eos_token_id"] == [2, 4097]
    assert tok.eos_token == "<|im_end|>" and tok.stop_ids == [2, 4097]
    text = "<|im_start|>assistant\n<think>\nr\n</think>\n<tool_call>\n</tool_call><|im_end|>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == \
        "assistant\n<think>\nr\n</think>\n<tool_call>\n</tool_call>"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name."},
        "unit": {"type": "string", "description": "Temperature unit.", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I will call get_weather.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nIt says 21.\n</think>\nIt is 21 degrees and sunny."},
]
# The Nemotron 3 format, written out by hand: an empty system turn when there is none, tools in the system
# turn, earlier turns' reasoning dropped, tool calls as <tool_call> blocks, tool results in one user turn.
TOOL_CHAT_TEXT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    "<function>\n<name>get_weather</name>\n<description>Get the current weather in a city.</description>\n"
    "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>The city name.</description>\n"
    "</parameter>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<description>Temperature unit."
    "</description>\n<enum>[\"celsius\", \"fahrenheit\"]</enum>\n</parameter>\n<required>[\"city\"]</required>\n"
    "</parameters>\n</function>\n</tools>\n\nTo call a function, reply with this block and nothing after it:\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n"
    "</tool_call>\nGive every required parameter; any reasoning comes before the block. If no function fits, answer "
    "in words.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n</think>\nHello.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nI will call get_weather.\n</think>\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n</tool_response>\n<tool_response>\nsunny\n"
    "</tool_response>\n<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nIt says 21.\n</think>\nIt is 21 degrees and sunny.<|im_end|>\n"
)
RENDER_CASES = [
    ([{"role": "user", "content": "What is a list?"}], {}),
    ([{"role": "user", "content": "What is a list?"}], {"enable_thinking": False}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], {"enable_thinking": False}),
    (TOOL_CHAT, {"tools": TOOLS}),
    (TOOL_CHAT, {"tools": TOOLS, "enable_thinking": False}),
    (TOOL_CHAT, {"tools": TOOLS, "truncate_history_thinking": False}),
    (TOOL_CHAT[1:4], {"tools": TOOLS}),  # tools without a system message
]


def test_the_shipped_template_renders_nemotron_3s_format():
    """The Nemotron 3 format spelled out by hand, and the two generation prompts: `<think>\\n` (the reply
    starts with reasoning; the server's split then starts inside it) or an empty `<think></think>`."""
    from hybrid.serving.messages import render_chat

    _, tok = hybrid.load(CKPT, dtype="fp32")
    assert tok.apply_chat_template(TOOL_CHAT, add_generation_prompt=False, tools=TOOLS) == TOOL_CHAT_TEXT
    user = [{"role": "user", "content": "Hi"}]
    thinking, direct = render_chat(tok, user), render_chat(tok, user, {"enable_thinking": False})
    assert thinking.text == \
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert direct.text == thinking.text.removesuffix("<think>\n") + "<think></think>"
    assert thinking.opened_thinking and not direct.opened_thinking
    # each turn's prompt is a prefix of the next one's, in both modes (the prefix cache resumes at it)
    for kwargs in ({}, {"enable_thinking": False}):
        first = tok.encode_chat(user, **kwargs)
        second = tok.encode_chat(user + [{"role": "assistant", "content": "Hello."}, *user], **kwargs)
        assert second[:len(first)] == first
    with pytest.raises(ValueError, match="tool call arguments must be an object"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"a": 1}'}}]}])


@pytest.mark.parametrize("case", range(len(RENDER_CASES)))
def test_the_shipped_template_renders_and_encodes_as_transformers_does(case):
    """Our sandboxed rendering and encoding against transformers' `apply_chat_template` with the same files."""
    from transformers import AutoTokenizer

    messages, kwargs = RENDER_CASES[case]
    theirs = AutoTokenizer.from_pretrained(CKPT)
    _, ours = hybrid.load(CKPT, dtype="fp32")
    for generation_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)
        assert ours.encode(text, add_special_tokens=False) == list(theirs.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False, **kwargs))
