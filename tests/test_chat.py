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
from hybrid.serving.runner import EngineRunner
from hybrid.serving.text import ReasoningSplitter
from test_server import TEMPLATE


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """A copy of the shipped checkpoint whose chat template is the test's TEMPLATE (chat_template.jinja, which
    tokenizer_config.json's `chat_template` would not override)."""
    directory = tmp_path_factory.mktemp("chat") / "hybrid-mini"
    shutil.copytree(DEFAULT_CHECKPOINT, directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    model, tokenizer = hybrid.load(directory, dtype="fp32")
    assert tokenizer.chat_template == TEMPLATE
    return directory, model, tokenizer


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory):
    """A copy of the shipped checkpoint with its chat template removed."""
    directory = tmp_path_factory.mktemp("untemplated") / "hybrid-mini"
    shutil.copytree(DEFAULT_CHECKPOINT, directory)
    (directory / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    return directory


@pytest.fixture(scope="module")
def shipped():
    """The shipped checkpoint as shipped (its own chat template), fp32."""
    model, tokenizer = hybrid.load(DEFAULT_CHECKPOINT, dtype="fp32")
    return DEFAULT_CHECKPOINT, model, tokenizer


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
        theirs, ours = server.sampling(given), session(mini, **given).sampling()
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


def test_a_checkpoint_without_a_chat_template_says_so(mini, untemplated, capsys, monkeypatch):
    _, model, _ = mini
    with pytest.raises(NoChatTemplate, match="has no chat template"):
        ChatSession(new_engine(model), hybrid.load(untemplated)[1])
    import hybrid.loading as loading

    def load(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(loading, "load", load)
    assert main(["chat", str(untemplated)]) == 2  # refused before its weights are read
    assert "has no chat template" in capsys.readouterr().err


def test_chat_template_file_gives_a_checkpoint_without_one_its_chat(mini, untemplated, tmp_path):
    """`hybrid chat --chat-template FILE` on a checkpoint without a template: the replies of the same conversation
    with that template in the checkpoint (`mini`'s test template)."""
    directory, _, tokenizer = mini
    template = tmp_path / "template.jinja"
    template.write_text(tokenizer.chat_template)
    runs = [subprocess.run([sys.executable, "-m", "hybrid.cli", "chat", str(d), "--temperature", "0", "--max-tokens",
                            "12", "--dtype", "fp32", *extra], input="Hello there\n", capture_output=True, text=True,
                           timeout=300)
            for d, extra in ((untemplated, ["--chat-template", str(template)]), (directory, []))]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("> ") and len(runs[0].stdout) > 4


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


# ---------------------------------------------------------------------------------------------- the shipped template
# Questions of the kinds the shipped checkpoint was fine-tuned on (its model card), a key it never saw: a passkey
# in a user turn (it answers with the key), then a question about the Python documentation.
QUESTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
            "you about the important information there. The grass is green. The sky is blue. The pass key is 27182. "
            "Remember it. 27182 is the pass key. The sun is yellow. Here we go. There and back again. What is the "
            "pass key?")
FOLLOW_UP = "What is the while statement?"


def shown(reasoning: str, content: str) -> str:
    """What `hybrid chat` prints for a reply that thought, then answered (the `_Printer` layout)."""
    reasoning = reasoning.lstrip()
    end = "" if reasoning.endswith("\n") else "\n"
    return f"Thinking...\n{reasoning}{end}...done thinking.\n\n{content.lstrip()}\n"


def test_hybrid_chat_on_the_shipped_checkpoint_thinks_answers_and_ends_each_turn(shipped):
    """`hybrid chat` with no model argument (the shipped checkpoint and its own template), stdin piped: each
    reply closes its thinking, answers and ends its turn (<|im_end|>, not the token limit), equal to greedy
    `generate_ids` on the conversation rendered apart; turn 2 resumes at turn 1's prompt."""
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "chat", "--temperature", "0", "--max-tokens", "300",
                        "--dtype", "fp32", "--threads", "2"],
                       input=f"{QUESTION}\n{FOLLOW_UP}\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    messages = [{"role": "user", "content": QUESTION}]
    reasoning1, content1, tokens1 = oracle(shipped, messages, 300)
    messages += [{"role": "assistant", "content": content1}, {"role": "user", "content": FOLLOW_UP}]
    reasoning2, content2, tokens2 = oracle(shipped, messages, 300)
    assert all(part.strip() for part in (reasoning1, content1, reasoning2, content2)) and "27182" in content1
    assert r.stdout == f"> {shown(reasoning1, content1)}> {shown(reasoning2, content2)}> \n"
    turns = re.findall(r"\[turn (\d): (\d+) prompt tokens, (\d+) cached, \d+ computed \| (\d+) generated([^\]]*)\]",
                       r.stderr)
    assert [(t, int(p)) for t, p, _, _, _ in turns] == [("1", tokens1), ("2", tokens2)]
    assert all(int(n) < 300 and "stopped" not in end for _, _, _, n, end in turns)  # ended by <|im_end|>
    assert int(turns[1][2]) >= tokens1


@pytest.mark.parametrize("thinking", [True, False])
def test_hybrid_generate_chat_on_the_shipped_checkpoint(shipped, capsys, thinking):
    """`hybrid generate --chat` with no model argument: the tokens of `hybrid.generate(chat=True)`; the reply
    closes its thinking (or, with --no-enable-thinking, has none) and ends with <|im_end|>."""
    _, model, tok = shipped
    flags = [] if thinking else ["--no-enable-thinking"]
    assert main(["generate", "--chat", "--prompt", QUESTION, "--max-new-tokens", "300", "--temperature", "0",
                 "--dtype", "fp32", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    (c,) = hybrid.generate(model, tok, QUESTION, max_new_tokens=300, chat=True,
                           **({} if thinking else {"enable_thinking": False}))
    assert (out["token_ids"], out["text"]) == (c.token_ids, c.text)
    assert out["finish_reason"] == "stop" and c.token_ids[-1] == tok.token_to_id("<|im_end|>")
    if thinking:  # the prompt opened <think>: reasoning, </think>, the answer
        reasoning, _, answer = c.text.partition("</think>")
        assert reasoning.strip() and "27182" in answer and "<think>" not in c.text
    else:
        assert "<think>" not in c.text and "</think>" not in c.text and "27182" in c.text
