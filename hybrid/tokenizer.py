"""Text in and out: a `tokenizers` fast tokenizer, the chat template, and the stop ids.

- `tokenizer.json` is read with the `tokenizers` library (no slow tokenizers, no remote code).
- The chat template comes from `chat_template.jinja` or `tokenizer_config.json` (`chat_template`), and is
  rendered in Jinja's immutable sandbox, as transformers does (`raise_exception`, `strftime_now`, a
  `tojson` that keeps non-ASCII text).
- Stop ids are the union of config.json's, generation_config.json's and the tokenizer's eos ids: Nemotron 3
  chat models end turns with `<|im_end|>` (the tokenizer's eos) while config.json says 2.
"""

from __future__ import annotations

import json
import reprlib
from datetime import datetime
from pathlib import Path

import tokenizers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybrid.checkpoint_files import CheckpointError


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


def _token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ids(value, path: Path) -> list[int]:
    """generation_config.json's `eos_token_id`: an id, a list of ids, or null. Raises CheckpointError otherwise."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(map(_token_id, ids)):
        raise CheckpointError(f"{path}: `eos_token_id` must be a token id (an integer >= 0), a list of them, or null, "
                              f"got {reprlib.repr(value)}")
    return ids


class Tokenizer:
    """Encode, decode, chat template, stop ids.

    Attributes:
        stop_ids: token ids that end generation (see the module docstring).
        bos_token / eos_token / pad_token_id: from the tokenizer config, when present.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None = None,
                 special_tokens: dict | None = None, stop_ids: list[int] | None = None, pad_token_id: int | None = None):
        self._tok = tokenizer
        self.chat_template = chat_template
        special = special_tokens or {}
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.stop_ids = sorted(set(stop_ids or []))
        self.pad_token_id = pad_token_id

    @classmethod
    def from_dir(cls, directory: str | Path, config_eos: list[int] | None = None, config_pad: int | None = None) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
        generation_config.json from `directory`.

        Raises:
            CheckpointError: tokenizer.json missing or unreadable, a JSON file that does not parse, a chat_template.jinja
                that is not UTF-8, or a generation_config.json `eos_token_id` / `pad_token_id` that is no token id.
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
        if (directory / "chat_template.jinja").exists():
            try:
                template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{directory / 'chat_template.jinja'}: not valid UTF-8 ({e})") from None
        elif isinstance(tok_config.get("chat_template"), str):
            template = tok_config["chat_template"]
        elif isinstance(tok_config.get("chat_template"), list):  # named templates: take "default"
            template = next((t["template"] for t in tok_config["chat_template"] if isinstance(t, dict)
                             and t.get("name") == "default" and isinstance(t.get("template"), str)), None)

        stop = set(config_eos or []) | set(_ids(generation.get("eos_token_id"), directory / "generation_config.json"))
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            stop.add(tok.token_to_id(special["eos_token"]))
        if generation.get("pad_token_id") is not None and not _token_id(generation["pad_token_id"]):
            raise CheckpointError(f"{directory / 'generation_config.json'}: `pad_token_id` must be a token id "
                                  f"(an integer >= 0) or null, got {reprlib.repr(generation['pad_token_id'])}")
        pad = tok.token_to_id(special["pad_token"]) if "pad_token" in special else None
        if pad is None:
            pad = generation.get("pad_token_id", config_pad)
        return cls(tok, template, special, sorted(stop), pad)

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

    def tokens_from(self, first_id: int) -> dict[int, str]:
        """{id: token} of the entries numbered `first_id` or above, in id order (e.g. tokens added past a
        model's vocabulary, `config.vocab_size`)."""
        return dict(sorted((i, t) for t, i in self._tok.get_vocab(with_added_tokens=True).items() if i >= first_id))

    # ------------------------------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the checkpoint's template, sandboxed.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Nemotron 3).
        Raises:
            ValueError: the checkpoint has no chat template, or the template fails (its message kept).
        """
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json / chat_template.jinja)")
        try:
            template = _environment().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """Token ids of the rendered chat; the template carries its own special tokens."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _raise_exception(message: str):
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
