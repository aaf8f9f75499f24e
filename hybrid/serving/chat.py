"""`hybrid chat`: an interactive chat in the terminal over the serving engine.

    session = ChatSession(engine, tokenizer, ChatOptions(system="Be brief.", temperature=0))
    turn = session.reply("Name a colour.", on_text=lambda reasoning, content: ...)
    turn.content, turn.cached_tokens, turn.summary()   # the reply; prompt tokens the prefix cache served
    run_chat(session)                                  # the loop `hybrid chat` runs (stdin, stdout)

Each turn renders the whole conversation with the checkpoint's chat template (`hybrid.serving.messages`,
as `/v1/chat/completions` renders a request's messages) and runs it on an `Engine` with prefix caching,
built as `hybrid serve` builds its own (`hybrid.serving.serve.build_engine`); so turn N resumes at turn
N-1's prompt-end snapshot and computes only what came after it (the reply as the template re-renders it,
and the new message). A reply is what the server answers for the same messages and sampling parameters:
the same prompt ids, engine and defaults (`hybrid.serving.messages`: temperature 1, as OpenAI's; every
turn starts from `seed`, as every request does). For a template that uses `<think>` the reasoning is split
off (`hybrid.serving.text.ReasoningSplitter`) and only the content goes back into the conversation, as an
OpenAI client sends it back (templates drop earlier reasoning anyway).

Ctrl-C during a reply stops it after the engine step under way and keeps the partial reply in the
conversation, as llama.cpp's `llama-cli -cnv` does (it ends the interrupted turn with an end-of-turn token,
and the model sees that turn from then on); a second Ctrl-C before it stops ends the chat. At the prompt,
`/exit`, Ctrl-D (EOF) or Ctrl-C end the chat; `/reset` clears the conversation (the system prompt stays).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybrid.serving.messages import ChatPrompt, render_chat, sampling_params, template_thinks
from hybrid.serving.request import Status
from hybrid.serving.text import ReasoningSplitter, TextStream

DIM, RESET = "\x1b[2m", "\x1b[0m"
EXIT_COMMANDS = ("/exit", "/quit", "/bye")
RESET_COMMANDS = ("/reset", "/clear")
HELP = ("/exit (or Ctrl-D) ends the chat; /reset clears the conversation (the system prompt stays); /help shows "
        "this. A line ending in \\ continues on the next. Ctrl-C stops a reply (the partial reply stays in the "
        "conversation).")


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template: a conversation cannot be rendered."""

    def __init__(self, name: str):
        super().__init__(f"the model `{name}` has no chat template (tokenizer_config.json `chat_template` or "
                         "chat_template.jinja), so `hybrid chat` cannot render a conversation; use `hybrid generate "
                         "--prompt TEXT` for plain text")


class ContextFull(ValueError):
    """The conversation with the new message leaves no room to generate within the model length."""


@dataclass
class ChatOptions:
    """A chat's settings. None for a sampling number means the API's default (the server's, for a request
    that leaves it out); max_tokens None: the rest of the context (as the server's chat default; a reply
    stops at the model length whatever max_tokens says).
    thinking False passes `enable_thinking=False` to the template (as `chat_template_kwargs` do)."""

    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    thinking: bool = True

    def template_kwargs(self) -> dict:
        return {} if self.thinking else {"enable_thinking": False}


@dataclass
class Turn:
    """One reply: its reasoning and content, its prompt's tokens (and those the prefix cache served), the
    tokens generated, why it ended ("stop", "length" or "interrupted"), the decode speed (None for a
    reply of fewer than two tokens) and, when the context left was the reply's limit (no --max-tokens, or
    more than the room left), the model length it stopped at."""

    number: int
    reasoning: str
    content: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    finish_reason: str
    decode_tokens_per_s: float | None
    context_full_at: int | None = None

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def summary(self) -> str:
        rate = self.decode_tokens_per_s
        speed = f", {rate:.1f} tok/s" if rate is not None and math.isfinite(rate) else ""
        end = {"length": " | stopped at the token limit", "interrupted": " | interrupted"}.get(self.finish_reason, "")
        if self.finish_reason == "length" and self.context_full_at is not None:
            end = (f" | stopped at the model length ({self.context_full_at:,} tokens, --max-model-len): the context "
                   "is full, /reset to start over")
        return (f"[turn {self.number}: {self.prompt_tokens} prompt tokens, {self.cached_tokens} cached, "
                f"{self.computed_tokens} computed | {self.generated_tokens} generated{speed}{end}]")


class ChatSession:
    """A conversation with one model on `engine` (see the module docstring).

    Args:
        engine: an `Engine` with a max_model_len (prefix caching on, for the reuse of earlier turns).
        tokenizer: the checkpoint's `hybrid.tokenizer.Tokenizer`, with a chat template.
        name: the model's name in messages.
    Raises:
        NoChatTemplate: the tokenizer has no chat template.
        ValueError: a sampling number out of range (see `hybrid.sampling.SamplingParams`), max_tokens not
            None or an integer >= 1, or an engine without a max_model_len.
    Attributes:
        messages: the conversation so far ([{"role", "content"}], the system prompt first if any).
    """

    def __init__(self, engine, tokenizer, options: ChatOptions | None = None, name: str = "model"):
        if tokenizer.chat_template is None:
            raise NoChatTemplate(name)
        if engine.max_model_len is None:
            raise ValueError("hybrid chat needs an engine with a max_model_len")
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.options = options or ChatOptions()
        o = self.options
        if o.max_tokens is not None and not (isinstance(o.max_tokens, int) and not isinstance(o.max_tokens, bool)
                                             and o.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {o.max_tokens!r}")
        self.sampling()  # checks the numbers now
        self.thinks = template_thinks(tokenizer)
        self.reset()

    def sampling(self):
        """This chat's `SamplingParams` (a new one per turn: a seeded turn starts from the seed, as a request)."""
        o = self.options
        return sampling_params(o.temperature, o.top_p, o.top_k, o.seed, self.tokenizer.sampling_defaults)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays); the turn count starts again."""
        self.messages: list[dict] = [{"role": "system", "content": self.options.system}] if self.options.system else []
        self.turns = 0

    def prompt(self, text: str) -> ChatPrompt:
        """The prompt of the next turn with the user's `text` (the conversation so far, rendered).

        Raises:
            ValueError: the template fails to render.
        """
        return render_chat(self.tokenizer, self.messages + [{"role": "user", "content": text}],
                           self.options.template_kwargs())

    def reply(self, text: str, on_text: Callable[[str, str], None] | None = None,
              interrupted: Callable[[], bool] | None = None) -> Turn:
        """Answer the user's `text`: stream `on_text(reasoning delta, content delta)` as it comes, stop once
        `interrupted()` is true (checked between engine steps), add the message and the reply's content to
        the conversation.

        Raises:
            ContextFull: the conversation with `text` leaves no token to generate (nothing is added).
            ValueError: the template fails to render (nothing is added).
        """
        prompt = self.prompt(text)
        engine, tok = self.engine, self.tokenizer
        room = engine.max_model_len - len(prompt.ids)
        if room < 1:
            raise ContextFull(f"the conversation with this message is {len(prompt.ids):,} tokens and the model "
                              f"length is {engine.max_model_len:,} (--max-model-len): /reset to start over")
        max_tokens = min(self.options.max_tokens or room, room)
        capped = self.options.max_tokens is None or self.options.max_tokens >= room  # the context is the limit
        request_id = engine.add_checked(engine.check_request(prompt.ids, self.sampling(), max_tokens, tok.stop_ids,
                                                             "the conversation"))
        stream = TextStream(tok, (), tok.stop_ids)
        splitter = ReasoningSplitter(prompt.opened_thinking) if self.thinks else None
        parts = ["", ""]

        def emit(delta: str, final: bool = False) -> None:
            r, c = splitter.feed(delta) if splitter is not None else ("", delta)
            if final and splitter is not None:
                r2, c2 = splitter.finish()
                r, c = r + r2, c + c2
            parts[0], parts[1] = parts[0] + r, parts[1] + c
            if on_text is not None and (r or c):
                on_text(r, c)

        stopped = False
        try:
            request = engine.requests[request_id]
            while request.status is not Status.FINISHED:
                if interrupted is not None and interrupted():
                    engine.abort(request_id)
                    stopped = True
                    break
                for out in engine.step():
                    if out.request_id == request_id and out.new_token_ids:
                        emit(stream.add(out.new_token_ids))
            emit(stream.finish(), final=True)
            completion = engine.completion(request_id)
        finally:  # whatever happened (a second Ctrl-C, a closed stdout), the request lets go of its blocks
            engine.abort(request_id)
            engine.release(request_id)
        self.messages = self.messages + [{"role": "user", "content": text}, {"role": "assistant", "content": parts[1]}]
        self.turns += 1
        return Turn(self.turns, parts[0], parts[1], len(prompt.ids), completion.cached_tokens,
                    len(completion.token_ids), "interrupted" if stopped else completion.finish_reason,
                    completion.decode_tokens_per_s, engine.max_model_len if capped else None)


class _Printer:
    """Writes a reply as it streams: the thinking between "Thinking..." and "...done thinking." (dim on a
    terminal; or not at all), then the content; leading whitespace of each part is dropped."""

    def __init__(self, out, color: bool, show_thinking: bool):
        self.out, self.color, self.show_thinking = out, color, show_thinking
        self.part: str | None = None
        self.last = ""

    def start(self) -> None:
        self.part, self.last = None, ""

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.last = text

    def _close_thinking(self) -> None:
        self._write(("" if self.last.endswith("\n") else "\n") + "...done thinking." + (RESET if self.color else "")
                    + "\n\n")

    def __call__(self, reasoning: str, content: str) -> None:
        if reasoning and self.show_thinking and self.part in (None, "thinking"):
            if self.part is None:
                reasoning = reasoning.lstrip()
                if reasoning:
                    self._write((DIM if self.color else "") + "Thinking...\n")
                    self.part = "thinking"
            self._write(reasoning)
        if content:
            if self.part != "content":
                content = content.lstrip()
                if content and self.part == "thinking":
                    self._close_thinking()
                if content:
                    self.part = "content"
            self._write(content)
        self.out.flush()

    def end(self) -> None:
        if self.part == "thinking":
            self._close_thinking()
        elif self.part == "content":
            self._write("\n")
        self.out.flush()


class _CtrlC:
    """While a reply runs: the first SIGINT asks it to stop (`requested`), a second one raises
    KeyboardInterrupt as usual. Installed only on the main thread (the only one Python delivers signals to)."""

    def __enter__(self) -> "_CtrlC":
        self.requested, self._installed, self._previous = False, False, None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)


def _styled(stream) -> bool:
    """Whether `stream` takes ANSI styles: a terminal, NO_COLOR unset, TERM not dumb."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def _read_message(read_line: Callable[[str], str]) -> str:
    """One message: a line, and the next ones while a line ends in a backslash (llama.cpp's continuation)."""
    lines, line = [], read_line("> ")
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line("... ")
    return "\n".join(lines + [line])


def run_chat(session: ChatSession, read_line: Callable[[str], str] = input, out=None, err=None,
             show_thinking: bool = True, color: bool | None = None) -> int:
    """The chat loop: read a message with `read_line(prompt)` (EOFError: the end), stream the reply to `out`
    (default stdout), and after it a line of its numbers to `err` (default stderr); commands: see `HELP`.
    Returns the exit status: 0 (`/exit`, EOF) or 130 (Ctrl-C at the prompt, or twice during a reply).
    `color`: style the thinking and the numbers dim (default: when the stream is a terminal)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    printer = _Printer(out, _styled(out) if color is None else color, show_thinking)
    dim = _styled(err) if color is None else color

    def note(text: str, styled: bool = False) -> None:
        print(f"{DIM}{text}{RESET}" if styled and dim else text, file=err, flush=True)

    note(f"chat with {session.name} ({session.engine.max_model_len:,} tokens of context); /help for the commands")
    while True:
        try:
            text = _read_message(read_line).strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in EXIT_COMMANDS:
                return 0
            if command in RESET_COMMANDS:
                session.reset()
                note("[the conversation was cleared]", styled=True)
            elif command in ("/help", "/?"):
                note(HELP)
            else:
                note(f"unknown command {command}; /help lists the commands")
            continue
        printer.start()
        try:
            with _CtrlC() as ctrl_c:
                turn = session.reply(text, printer, lambda: ctrl_c.requested)
        except ContextFull as e:
            printer.end()
            note(f"error: {e}")
            continue
        except KeyboardInterrupt:
            printer.end()
            return 130
        printer.end()
        note(turn.summary(), styled=True)


def chat(args) -> int:
    """The `hybrid chat` command: load the checkpoint (after checking that its tokenizer has a chat
    template), build the engine as `hybrid serve` does (one conversation), run the loop on stdin, save the
    prefix cache file at the end."""
    import torch

    from hybrid.checkpoint_files import resolve_checkpoint
    from hybrid.loading import load
    from hybrid.serving.serve import build_engine, save_prefix_cache
    from hybrid.tokenizer import Tokenizer

    name = Path(str(args.model)).name
    directory = resolve_checkpoint(args.model)
    template = Tokenizer.from_dir(directory)  # its chat template, checked before the weights are read
    if args.chat_template is not None:
        template.use_chat_template(args.chat_template)
    if template.chat_template is None:
        raise NoChatTemplate(name)
    options = ChatOptions(system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, thinking=args.thinking)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(directory, dtype=args.dtype, device=args.device)
    if args.chat_template is not None:
        tokenizer.use_chat_template(args.chat_template)
    engine = build_engine(model, args, max_num_seqs=1)
    session = ChatSession(engine, tokenizer, options, name)
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    try:
        return run_chat(session, show_thinking=not args.hide_thinking)
    finally:
        save_prefix_cache(engine, args)
