"""What the chat endpoint (`hybrid.serving.api`) and `hybrid chat` (`hybrid.serving.chat`) share: a
conversation rendered into a prompt by the checkpoint's chat template, and the sampling defaults (the
checkpoint's, else the API's).

    prompt = render_chat(tokenizer, messages, {"enable_thinking": False})   # .ids, .text, .opened_thinking
    template_thinks(tokenizer)     # the template uses <think>: a reply is split into reasoning and content
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.sampling import SamplingParams
from hybrid.serving.text import THINK_OPEN

# The OpenAI API's defaults, which the server applies to a request that does not set them: temperature 1,
# no top-p and no top-k filtering (tests/test_chat.py checks them against `api.Server.sampling`).
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 1.0, 1.0, -1


def template_thinks(tokenizer) -> bool:
    """Whether the checkpoint's chat template uses `<think>` (its replies carry reasoning to split off)."""
    return tokenizer.chat_template is not None and THINK_OPEN in tokenizer.chat_template


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its token ids, its text, and whether it ends inside `<think>` (the
    template opened the thinking itself, so the reply starts with reasoning)."""

    ids: list[int]
    text: str
    opened_thinking: bool


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> ChatPrompt:
    """`messages` ([{"role", "content"}, ...]) rendered with the generation prompt (sandboxed; the template
    carries its own special tokens) and encoded; `template_kwargs` reach the template (`enable_thinking`).

    Raises:
        ValueError: the checkpoint has no chat template, or the template fails to render (see
            `hybrid.tokenizer.Tokenizer.apply_chat_template`).
    """
    text = tokenizer.apply_chat_template(messages, **(template_kwargs or {}))
    return ChatPrompt(tokenizer.encode(text, add_special_tokens=False), text, text.rstrip().endswith(THINK_OPEN))


def sampling_params(temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                    seed: int | None = None, defaults: dict | None = None, **penalties) -> SamplingParams:
    """A request's sampling: what it sets, else the checkpoint's `defaults` (`Tokenizer.sampling_defaults`, from
    its generation_config.json, as vLLM applies them), else the API's; `penalties` (repetition_penalty,
    frequency_penalty, presence_penalty) go to `SamplingParams` as given.

    Raises:
        ValueError: see `hybrid.sampling.SamplingParams`.
    """
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    api = {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "top_k": DEFAULT_TOP_K}
    value = {k: v if v is not None else (defaults or {}).get(k, api[k]) for k, v in given.items()}
    return SamplingParams(value["temperature"], value["top_k"], value["top_p"], seed, **penalties)
