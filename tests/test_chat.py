"""`hybrid chat` (`hybrid.serving.chat`): the chat loop driven with scripted input, in process and as a
subprocess, on the shipped checkpoint with a Nemotron-style chat template that opens `<think>`. Oracles:
`hybrid.generate_ids` on the conversation rendered independently (greedy), and the real server app (the
same messages and seeded sampling, through `httpx.ASGITransport`)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

import hybrid
from hybrid.cli import DEFAULT_CHECKPOINT, main
from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams
from hybrid.serving.api import Server, create_app
from hybrid.serving.chat import ChatOptions, ChatSession, ContextFull, NoChatTemplate, run_chat
from hybrid.serving.engine import Engine
from hybrid.serving.messages import sampling_params
from hybrid.serving.runner import EngineRunner
from hybrid.serving.text import ReasoningSplitter
from test_server import TEMPLATE


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "hybrid-mini"
    shutil.copytree(DEFAULT_CHECKPOINT, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = hybrid.load(directory, dtype="fp32")
    return directory, model, tokenizer


def new_engine(model, max_model_len: int = 1024) -> Engine:
    return Engine(model, num_blocks=256, max_num_seqs=1, max_model_len=max_model_len, prefix_caching=True)


def session(mini, max_model_len: int = 1024, **options) -> ChatSession:
    _, model, tokenizer = mini
    return ChatSession(new_engine(model, max_model_len), tokenizer, ChatOptions(**options), "hybrid-mini")


def oracle(mini, messages: list[dict], max_tokens: int, thinking: bool = True) -> tuple[str, str, int]:
    """(reasoning, content, prompt tokens) of greedy `generate_ids` on the rendered conversation."""
    _, model, tok = mini
    text = tok.apply_chat_template(messages, **({} if thinking else {"enable_thinking": False}))
    ids = tok.encode(text, add_special_tokens=False)
    (c,) = generate_ids(model, [ids], max_tokens, SamplingParams(0.0), tok.stop_ids)
    out = tok.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids)
    splitter = ReasoningSplitter(in_thinking=text.endswith("<think>\n"))
    r, c_ = splitter.feed(out)
    r2, c2 = splitter.finish()
    return r + r2, c_ + c2, len(ids)


def script(*lines: str):
    """A read_line that answers with `lines`, then EOF; it records the prompts it was asked with."""
    queue = list(lines)
    prompts = []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not queue:
            raise EOFError
        return queue.pop(0)

    read_line.prompts = prompts
    return read_line


# ---------------------------------------------------------------------------------------------- replies
def test_replies_equal_generate_on_the_rendered_conversation_and_turn_2_resumes_at_turn_1s_prompt(mini):
    """With thinking (the template opens <think>); without it, the loop tests below."""
    chat = session(mini, temperature=0, max_tokens=6)
    streamed = []
    first = chat.reply("Name a colour.", on_text=lambda r, c: streamed.append((r, c)))
    messages = [{"role": "user", "content": "Name a colour."}]
    reasoning, content, prompt_tokens = oracle(mini, messages, 6)
    assert (first.reasoning, first.content, first.prompt_tokens) == (reasoning, content, prompt_tokens)
    assert ("".join(r for r, _ in streamed), "".join(c for _, c in streamed)) == (reasoning, content)
    assert reasoning  # the template opened <think>
    assert first.cached_tokens == 0 and first.generated_tokens == 6 and first.finish_reason == "length"

    second = chat.reply("And another one?")
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "And another one?"}]
    assert chat.messages == messages + [{"role": "assistant", "content": second.content}]
    reasoning, content, prompt_tokens = oracle(mini, messages, 6)
    assert (second.reasoning, second.content, second.prompt_tokens) == (reasoning, content, prompt_tokens)
    assert second.cached_tokens >= first.prompt_tokens  # turn 1's prompt-end snapshot
    assert second.computed_tokens == second.prompt_tokens - second.cached_tokens
    assert second.summary().startswith(f"[turn 2: {prompt_tokens} prompt tokens, {second.cached_tokens} cached, "
                                       f"{second.computed_tokens} computed | 6 generated")
    assert not chat.engine.requests  # every request was released


def test_seeded_replies_equal_the_servers_for_the_same_messages(mini):
    """The chat endpoint of the real app, on an engine of its own: the same reasoning, content and cached
    tokens in both turns; and the chat's default sampling is the server's for a request that sets nothing."""
    _, model, tok = mini
    runner = EngineRunner(new_engine(model))
    server = Server(runner, tok, "hybrid-mini")
    body = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7, "max_tokens": 6}

    async def ask(messages):
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json={"messages": messages, **body})
            assert r.status_code == 200, r.text
            return r.json()

    try:
        chat = session(mini, temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=6)
        messages = []
        for text in ("Name a colour.", "And another one?"):
            turn = chat.reply(text)
            messages.append({"role": "user", "content": text})
            answer = asyncio.run(ask(messages))
            message = answer["choices"][0]["message"]
            assert (turn.reasoning, turn.content) == (message["reasoning_content"], message["content"])
            assert turn.prompt_tokens == answer["usage"]["prompt_tokens"]
            assert turn.cached_tokens == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            messages.append({"role": "assistant", "content": message["content"]})
        assert turn.cached_tokens > 0
    finally:
        runner.close()
    for given in ({}, {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "seed": 3}):
        theirs, ours = server.sampling(given), sampling_params(**given)
        assert (theirs.temperature, theirs.top_k, theirs.top_p, theirs.seed) == \
               (ours.temperature, ours.top_k, ours.top_p, ours.seed)


# ---------------------------------------------------------------------------------------------- the loop
def test_the_loop_streams_replies_counts_turns_resets_and_knows_its_commands(mini):
    chat = session(mini, temperature=0, max_tokens=4, thinking=False, system="Be brief.")
    out, err = io.StringIO(), io.StringIO()
    read_line = script("", "Name a\\", "colour.", "/nonsense", "/reset", "Name a\\", "colour.", "/help", "/exit", "x")
    assert run_chat(chat, read_line, out, err) == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a\ncolour."}]
    _, content, prompt_tokens = oracle(mini, messages, 4, thinking=False)
    assert out.getvalue() == f"{content.lstrip()}\n" * 2  # the same reply after /reset: the same conversation
    assert read_line.prompts == ["> ", "> ", "... ", "> ", "> ", "> ", "... ", "> ", "> "]  # "x" never read
    log = err.getvalue()
    assert "unknown command /nonsense" in log and "[the conversation was cleared]" in log and "/reset clears" in log
    assert re.findall(r"\[turn (\d+): (\d+) prompt tokens", log) == [("1", str(prompt_tokens))] * 2
    assert chat.messages == messages + [{"role": "assistant", "content": content}]


def test_eof_ends_the_chat_and_thinking_is_shown_apart_or_hidden(mini):
    reasoning, _, _ = oracle(mini, [{"role": "user", "content": "Hi"}], 4)
    for show in (True, False):
        out = io.StringIO()
        assert run_chat(session(mini, temperature=0, max_tokens=4), script("Hi"), out, io.StringIO(),
                        show_thinking=show) == 0
        shown = f"Thinking...\n{reasoning.lstrip().removesuffix(chr(10))}\n...done thinking.\n\n" if show else ""
        assert out.getvalue() == shown + "\n"  # the thinking never closed: no content; EOF ends the line


class InterruptingOutput(io.StringIO):
    """stdout that sends this process SIGINT (Ctrl-C) `times` times at its `at`-th write."""

    def __init__(self, at: int, times: int = 1):
        super().__init__()
        self.at, self.times, self.writes = at, times, 0

    def write(self, text):
        self.writes += 1
        if self.writes == self.at:
            for _ in range(self.times):
                signal.raise_signal(signal.SIGINT)
        return super().write(text)


def test_ctrl_c_stops_the_reply_and_keeps_the_partial_reply_in_the_conversation(mini):
    chat = session(mini, temperature=0, max_tokens=8, thinking=False)
    handler = signal.getsignal(signal.SIGINT)
    out, err = InterruptingOutput(2), io.StringIO()
    assert run_chat(chat, script("Name a colour.", "And another one?"), out, err) == 0
    assert re.search(r"\[turn 1: .* \| interrupted\]", err.getvalue())
    first = [{"role": "user", "content": "Name a colour."}]
    _, full, _ = oracle(mini, first, 8, thinking=False)
    partial = chat.messages[1]["content"]
    assert partial and full.startswith(partial) and len(partial) < len(full)  # stopped early, what was streamed
    assert out.getvalue().startswith(partial.lstrip())
    messages = first + [{"role": "assistant", "content": partial}, {"role": "user", "content": "And another one?"}]
    _, content, _ = oracle(mini, messages, 8, thinking=False)
    assert chat.messages[3]["content"] == content  # the next turn saw the partial reply
    assert signal.getsignal(signal.SIGINT) is handler  # put back after each reply


def test_ctrl_c_twice_during_a_reply_ends_the_chat_and_frees_the_engine(mini):
    chat = session(mini, temperature=0, max_tokens=40, thinking=False)
    assert run_chat(chat, script("Name a colour.", "never read"), InterruptingOutput(2, times=2), io.StringIO()) == 130
    assert not chat.engine.requests and chat.engine.slots.num_free == chat.engine.slots.num_slots


def test_a_conversation_past_the_model_length_is_a_clear_error_and_changes_nothing(mini):
    chat = session(mini, max_model_len=32, temperature=0)
    with pytest.raises(ContextFull, match=r"is \d+ tokens and the model length is 32.*/reset"):
        chat.reply("word " * 40)
    assert chat.messages == [] and chat.turns == 0
    err = io.StringIO()
    assert run_chat(chat, script("word " * 40), io.StringIO(), err) == 0
    assert "error: the conversation with this message is" in err.getvalue()


def test_a_checkpoint_without_a_chat_template_says_so(mini, capsys):
    _, model, _ = mini
    with pytest.raises(NoChatTemplate, match="has no chat template"):
        ChatSession(new_engine(model), hybrid.load(DEFAULT_CHECKPOINT)[1])
    assert main(["chat"]) == 2  # the shipped checkpoint, refused before its weights are read
    assert "has no chat template" in capsys.readouterr().err


def test_an_unwritable_prefix_cache_file_is_refused_before_loading(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["chat", "--prefix-cache-file", str(tmp_path / "file" / "p.safetensors")]) == 2
    assert "--prefix-cache-file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the command
def test_hybrid_chat_with_stdin_piped_gives_the_same_replies_and_saves_the_prefix_cache(mini, tmp_path):
    directory = mini[0]
    cache = tmp_path / "prefix.safetensors"
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "chat", str(directory), "--temperature", "0",
                        "--max-tokens", "4", "--no-thinking", "--dtype", "fp32", "--threads", "2",
                        "--max-model-len", "1024", "--prefix-cache-file", str(cache), "--max-num-batched-tokens", "64",
                        "--prefix-snapshot-interval", "32"],
                       input="Name a colour.\nAnd another one?\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    messages = [{"role": "user", "content": "Name a colour."}]
    _, first, first_tokens = oracle(mini, messages, 4, thinking=False)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And another one?"}]
    _, second, second_tokens = oracle(mini, messages, 4, thinking=False)
    assert r.stdout == f"> {first.lstrip()}\n> {second.lstrip()}\n> \n"
    turns = re.findall(r"\[turn (\d): (\d+) prompt tokens, (\d+) cached, (\d+) computed \| 4 generated", r.stderr)
    assert [(t, int(p)) for t, p, _, _ in turns] == [("1", first_tokens), ("2", second_tokens)]
    assert int(turns[1][2]) >= first_tokens and cache.exists()
    assert "steps of 64 tokens, prefix snapshots every 32 tokens" in r.stderr  # read back from the engine


def test_the_engine_options_default_to_the_engines_defaults():
    """hybrid serve / chat's --max-num-batched-tokens and --prefix-snapshot-interval default to the engine's
    own defaults (the parser does not import them), and a snapshot interval off the block size is refused."""
    from hybrid.cli import build_parser
    from hybrid.serving.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from hybrid.serving.prefix import DEFAULT_SNAPSHOT_INTERVAL

    for command in ("serve", "chat"):
        args = build_parser().parse_args([command])
        assert (args.max_num_batched_tokens, args.prefix_snapshot_interval) == \
            (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_SNAPSHOT_INTERVAL)
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--prefix-snapshot-interval", "40"])


def test_a_reply_cut_by_the_model_length_says_so(mini):
    """--max-tokens past the room the context leaves: the reply stops at the model length and the turn's
    line says that the context is full, not that the token limit was reached; a reply stopped by
    --max-tokens itself says the token limit."""
    probe = session(mini, thinking=False)
    n = len(probe.prompt("Hi").ids)
    chat = session(mini, max_model_len=n + 3, temperature=0, max_tokens=500, thinking=False)
    turn = chat.reply("Hi")
    assert (turn.finish_reason, turn.generated_tokens, turn.context_full_at) == ("length", 3, n + 3)
    assert f"stopped at the model length ({n + 3:,} tokens, --max-model-len)" in turn.summary()
    short = session(mini, max_model_len=n + 3, temperature=0, max_tokens=2, thinking=False).reply("Hi")
    assert (short.finish_reason, short.generated_tokens, short.context_full_at) == ("length", 2, None)
    assert "stopped at the token limit" in short.summary()
