"""Text in and out: a `tokenizers` fast tokenizer, the chat template, and the stop ids.

- `tokenizer.json` is read with the `tokenizers` library (no slow tokenizers, no remote code).
- The chat template comes from `chat_template.jinja` or `tokenizer_config.json` (`chat_template`), and is
  rendered in Jinja's immutable sandbox, as transformers does (`raise_exception`, `strftime_now`, a
  `tojson` that keeps non-ASCII text).
- Stop ids are the union of config.json's, generation_config.json's and the tokenizer's eos ids: Nemotron 3
  chat models end turns with `<|im_end|>` (the tokenizer's eos) while config.json says 2.
- The checkpoint's sampling defaults are generation_config.json's `temperature`, `top_p` and `top_k` where
  present (as vLLM reads them), and greedy where it says `do_sample: false` (as transformers reads it); the
  command line, the server and `hybrid chat` use them for what a user or request does not set.
"""

from __future__ import annotations

import functools
import json
import math
import reprlib
from datetime import datetime
from pathlib import Path

import tokenizers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from hybrid.checkpoint_files import CheckpointError
from hybrid.config import ConfigError, check_field


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token given as a string or as `{"content": ...}` (tokenizer_config / special_tokens_map)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _checked(generation: dict, key: str, path: Path):
    """generation_config.json's `key` (`eos_token_id`: an id, a list of ids, or null; `pad_token_id`: an id or
    null), checked as config.json checks it (`hybrid.config.check_field`: ids in [0, 2^31)).

    Raises:
        CheckpointError: the value is no token id; the message names the file, the key and the value.
    """
    value = generation.get(key)
    try:
        check_field(key, value)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return value


def _sampling_defaults(generation: dict, path: Path) -> dict:
    """generation_config.json's sampling defaults: {"temperature", "top_p", "top_k"} where present, temperature 0
    (greedy) where `do_sample` is false.

    Raises:
        CheckpointError: a value out of its range (temperature a finite number >= 0, top_p in (0, 1], top_k an
            integer >= -1, do_sample a boolean); the message names the file, the key and the value.
    """
    checks = {"temperature": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
              "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
              "top_k": (lambda v: isinstance(v, int) and v >= -1, "an integer >= -1 (0 or -1: no limit)")}
    defaults = {}
    for key, (ok, expected) in checks.items():
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise CheckpointError(f"{path}: `{key}` must be {expected}, got {reprlib.repr(value)}")
        defaults[key] = value
    do_sample = generation.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise CheckpointError(f"{path}: `do_sample` must be true or false, got {reprlib.repr(do_sample)}")
    if do_sample is False:
        defaults["temperature"] = 0.0
    return defaults


def _ids(value) -> list[int]:
    return [] if value is None else value if isinstance(value, list) else [value]


class Tokenizer:
    """Encode, decode, chat template, stop ids.

    Attributes:
        stop_ids: token ids that end generation (see the module docstring).
        bos_token / eos_token / pad_token_id: from the tokenizer config, when present.
        sampling_defaults: {"temperature", "top_p", "top_k"}: what the checkpoint's generation_config.json says
            (see the module docstring); empty where it says nothing.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None = None,
                 special_tokens: dict | None = None, stop_ids: list[int] | None = None, pad_token_id: int | None = None,
                 template_source: str | None = None, sampling_defaults: dict | None = None):
        self._tok = tokenizer
        self.chat_template = chat_template
        self.template_source = template_source or "the chat template"  # where it came from, for messages
        special = special_tokens or {}
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.stop_ids = sorted(set(stop_ids or []))
        self.pad_token_id = pad_token_id
        self.sampling_defaults = dict(sampling_defaults or {})

    @classmethod
    def from_dir(cls, directory: str | Path, config_eos: list[int] | None = None, config_pad: int | None = None) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
        generation_config.json from `directory`.

        Raises:
            CheckpointError: tokenizer.json missing or unreadable, a JSON file that does not parse, a chat_template.jinja
                that is not UTF-8, a generation_config.json `eos_token_id` / `pad_token_id` that is no token id
                (an integer in [0, 2^31), as in config.json), or a sampling default out of its range
                (`_sampling_defaults`); the message names the file and the key.
        """
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{directory}: no tokenizer.json (a fast tokenizer file is required)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read the tokenizer ({e})") from None
        tok_config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        generation = _read_json(directory / "generation_config.json")

        special = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            text = _token_text(tok_config.get(key)) or _token_text(special_map.get(key))
            if text is not None:
                special[key] = text
        template = None
        source = f"{directory / 'tokenizer_config.json'} (`chat_template`)"
        if (directory / "chat_template.jinja").exists():
            source = str(directory / "chat_template.jinja")
            try:
                template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{directory / 'chat_template.jinja'}: not valid UTF-8 ({e})") from None
        elif isinstance(tok_config.get("chat_template"), str):
            template = tok_config["chat_template"]
        elif isinstance(tok_config.get("chat_template"), list):  # named templates: take "default"
            template = next((t["template"] for t in tok_config["chat_template"] if isinstance(t, dict)
                             and t.get("name") == "default" and isinstance(t.get("template"), str)), None)
        elif tok_config.get("chat_template") is not None:
            raise CheckpointError(f"{directory / 'tokenizer_config.json'}: `chat_template` must be a string or a "
                                  f"list of {{name, template}} objects, got {reprlib.repr(tok_config['chat_template'])}")

        generation_path = directory / "generation_config.json"
        stop = set(config_eos or []) | set(_ids(_checked(generation, "eos_token_id", generation_path)))
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            stop.add(tok.token_to_id(special["eos_token"]))
        _checked(generation, "pad_token_id", generation_path)
        pad = tok.token_to_id(special["pad_token"]) if "pad_token" in special else None
        if pad is None:
            pad = generation.get("pad_token_id", config_pad)
        return cls(tok, template, special, sorted(stop), pad, template_source=source,
                   sampling_defaults=_sampling_defaults(generation, generation_path))

    # ------------------------------------------------------------------------------------------ text
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens included (vLLM's logprobs `token`): a piece of a UTF-8
        character decodes to "\ufffd"."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`, which join into the text's UTF-8): a
        byte-level BPE token's own bytes, even a piece of a character; an added token's text, and any
        other tokenizer's decoded text, in UTF-8 (b"" for an id the tokenizer does not know)."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and token_id not in self._added_ids and all(c in _BYTE_OF_CHAR for c in token):
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        return self.token_text(token_id).encode("utf-8")

    @functools.cached_property
    def _byte_level(self) -> bool:
        return isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    def tokens_from(self, first_id: int) -> dict[int, str]:
        """{id: token} of the entries numbered `first_id` or above, in id order (e.g. tokens added past a
        model's vocabulary, `config.vocab_size`)."""
        return dict(sorted((i, t) for t, i in self._tok.get_vocab(with_added_tokens=True).items() if i >= first_id))

    # ------------------------------------------------------------------------------------------ chat
    def use_chat_template(self, path: str | Path) -> None:
        """Render chats with the template in the file `path` instead of the checkpoint's (`--chat-template FILE`,
        as vLLM's `--chat-template` and llama-server's `--chat-template-file`).

        Raises:
            ValueError: the file cannot be read or is not UTF-8 text (the message names it).
        """
        try:
            self.chat_template = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot read it as UTF-8 text ({e})") from None
        self.template_source = str(path)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the checkpoint's template, sandboxed.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Nemotron 3).
        Raises:
            ValueError: the checkpoint has no chat template; the template fails to parse or render (any
                exception: a syntax error, `raise_exception`, an unsafe operation, 1/0, deep recursion, a
                `range` beyond `MAX_RANGE`, ...); it renders an empty string or more than `MAX_RENDERED_CHARS`
                characters. The message names the template's file and the exception.
        """
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json / chat_template.jinja)")
        where = self.template_source
        try:
            template = _compiled(self.chat_template)
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except RecursionError:
            raise ValueError(f"{where}: chat template failed: it recurses too deeply (RecursionError)") from None
        except MemoryError:
            raise ValueError(f"{where}: chat template failed: it ran out of memory (MemoryError)") from None
        except TemplateError as e:  # syntax errors, raise_exception, the sandbox's SecurityError
            raise ValueError(f"{where}: chat template failed: {e}") from None
        except Exception as e:  # the template's own expressions: 1/0, "%d"|format("x"), ...
            raise ValueError(f"{where}: chat template failed: {type(e).__name__}: {e}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise ValueError(f"{where}: chat template rendered {len(text):,} characters, more than the limit of "
                             f"{MAX_RENDERED_CHARS:,}")
        if not text:
            raise ValueError(f"{where}: chat template rendered an empty string for these messages")
        return text

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """Token ids of the rendered chat; the template carries its own special tokens."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order (what a byte-level BPE vocabulary is written in)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()

MAX_RENDERED_CHARS = 2**24  # a rendered chat (16 Mi characters) far beyond any context window
MAX_RANGE = 100_000  # items of one `range()` in a template (jinja2's default is 100,000,000)


def _raise_exception(message: str):
    raise TemplateError(message)


def _sized(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a smaller `range`, and `*` / `**` bounded so that no expression of the
    template can build a huge string or list (`'ab' * 10**9`) or number (`10 ** 10 ** 10`)."""

    MAX_RANGE = MAX_RANGE
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _sized(seq) is not None and isinstance(n, int) and _sized(seq) * max(n, 0) > MAX_RENDERED_CHARS:
                    raise SecurityError(f"a repetition of {_sized(seq):,} items {n:,} times exceeds the limit of "
                                        f"{MAX_RENDERED_CHARS:,}")
        elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if abs(right) > 1024 and abs(left) > 1:
                raise SecurityError(f"the power {left!r} ** {right!r} is too large")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """The template `source` compiled once: compiling costs far more than rendering
    (docs/perf-log.md#chat-finetune), and every chat request renders; a compiled template renders reentrantly.
    A template that fails to compile raises each time (exceptions are not cached)."""
    return _environment().from_string(source)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
