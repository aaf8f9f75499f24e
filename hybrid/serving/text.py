"""A request's text as its tokens arrive: incremental detokenisation, stop strings, the reasoning part.

`TextStream` turns token ids into the text to send so far: an incomplete UTF-8 character is held back, and
so is any tail that could still become a stop string; a stop string ends the text before it (it is never
sent), wherever token boundaries fall. `ReasoningSplitter` then splits the text of a model that thinks
(Nemotron 3's `<think> ... </think>`) into `reasoning_content` and `content`, also across chunk boundaries,
whether the template already opened `<think>` or the model writes it.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class TextStream:
    """Args: tokenizer (`hybrid.tokenizer.Tokenizer`); stop: strings that end the text; skip_ids: token ids
    never shown (the stop ids: a finishing eos is not text)."""

    def __init__(self, tokenizer, stop: list[str] = (), skip_ids=()):
        self.tokenizer, self.stop, self.skip = tokenizer, [s for s in stop if s], set(skip_ids)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False  # a stop string was found: nothing more is sent
        self.text = ""  # the decoded text of the ids so far (sent or not)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def offset(self) -> int:
        """Where the next token's text starts in the decoded text: its length, less a trailing incomplete
        character ("\ufffd") that the next token's bytes may complete."""
        return len(self.text.rstrip("\ufffd"))

    def add(self, token_ids: list[int]) -> str:
        """The new text these tokens make sendable ("" while held back; nothing after a stop string)."""
        if self.stopped:
            return ""
        self.ids += [t for t in token_ids if t not in self.skip]
        text = self.text = self.tokenizer.decode(self.ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._send(text, cut)
        end = len(text) - self._hold
        if text.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            end = min(end, len(text) - 1)
        return self._send(text, end)

    def finish(self) -> str:
        """Whatever was held back, at the end of the request (a trailing incomplete character included)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        cut = self._stop_at(text)
        self.stopped = cut is not None
        return self._send(text, len(text) if cut is None else cut)

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.sent - self._hold)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _send(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        new, self.sent = text[self.sent:end], end
        return new


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Split streamed text into (reasoning, content) deltas at `<think>` / `</think>`.

    in_thinking: the prompt already opened `<think>` (the template did). Otherwise a `<think>` at the very
    start of the output (after whitespace) opens it; text that does not start so is all content. Thinking
    that never closes is all reasoning, and the content is then "" (never None).
    """

    def __init__(self, in_thinking: bool = False):
        self.state = "thinking" if in_thinking else "start"
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buffer, self.state = head[len(THINK_OPEN):], "thinking"
                elif THINK_OPEN.startswith(head):  # maybe the tag, still arriving
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "thinking":
                i = self.buffer.find(THINK_CLOSE)
                if i < 0:
                    keep = _partial_suffix(self.buffer, THINK_CLOSE)
                    reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self.buffer[:i]
                self.buffer, self.state = self.buffer[i + len(THINK_CLOSE):].lstrip("\n"), "after"
            elif self.state == "after":  # newlines right after </think> are not content
                if not self.buffer.strip("\n"):
                    return reasoning, content
                self.buffer, self.state = self.buffer.lstrip("\n"), "content"
            else:
                content += self.buffer
                self.buffer = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back (an unfinished tag is text of the current part)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "thinking":
            return rest, ""
        return "", rest if self.state in ("start", "content") else rest.lstrip("\n")
