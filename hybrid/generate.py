"""Autoregressive generation: several prompts at once, streaming, speed figures.

Generation runs on the serving engine (`hybrid.serving.engine.Engine`, one made per call, its KV pool growing
with the call): the prompts are packed sequences over paged KV blocks and Mamba state slots, prefilled in chunks
of `prefill_chunk_size` tokens beside the decode steps of the others, so a row gives the same tokens as the
prompt run alone and nothing is padded; with `speculative`, the engine drafts with the MTP block and verifies
in the same packed steps (`hybrid.serving.speculation`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

import torch

from hybrid.batch import check_max_new_tokens, check_prompts
from hybrid.cache import RESERVE_AHEAD
from hybrid.model import HybridForCausalLM
from hybrid.sampling import Completion, Sampling, SamplingParams, check_rank_draws, for_call
from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE
from hybrid.serving.engine import Engine

if TYPE_CHECKING:
    from hybrid.prefix_cache import PrefixCache

# Prompt tokens per prefill forward: 512 was the fastest of 256 / 512 / 2048 on the bench model, and larger
# chunks only add activation memory, the GEMMs are already efficient at 512 rows
# (docs/perf-log.md#prefill-chunk-size).
PREFILL_CHUNK_SIZE = 512


class _PositionNote:
    """One `UserWarning` per generation call when the sequence passes the config's max_position_embeddings
    (vLLM refuses past max_model_len; without positional encoding a note is enough)."""

    def __init__(self, limit: int | None):
        self.limit, self.noted = limit, False

    def check(self, positions: int) -> None:
        if self.limit and not self.noted and positions > self.limit:
            self.noted = True
            warnings.warn(f"the sequence passes the model's max_position_embeddings ({self.limit}) at {positions} "
                          "positions; generating on (no positional encoding limits it, but the model was not "
                          "trained this long)", UserWarning, stacklevel=4)

    def watch(self, prompts: list[list[int]], on_tokens: Callable[[list[int | None]], None] | None):
        """`on_tokens` wrapped to check each row's length (its prompt and the tokens so far) as tokens come."""
        lengths = [len(p) for p in prompts]

        def step(tokens: list[int | None]) -> None:
            for row, t in enumerate(tokens):
                if t is not None:
                    lengths[row] += 1
                    self.check(lengths[row])
            if on_tokens is not None:
                on_tokens(tokens)

        return step if self.limit else on_tokens


@torch.inference_mode()
def generate_ids(
    model: HybridForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    sampling: Sampling | None = None,
    stop_ids: list[int] | tuple[int, ...] = (),
    pad_id: int | None = 0,
    prefill_chunk_size: int = PREFILL_CHUNK_SIZE,
    on_tokens: Callable[[list[int | None]], None] | None = None,
    prefix_cache: "PrefixCache | None" = None,
    speculative: int = 0,
) -> list[Completion]:
    """Generate from token-id prompts, on the serving engine (`hybrid.serving.engine.Engine`): the prompts are
    packed sequences, not a padded batch, so each row gives the tokens it gives alone.

    Args:
        prompts: B lists of token ids, each non-empty.
        sampling: one `SamplingParams` for every row, or a list of B; each row draws from its own generator,
            started at its seed (a seeded one gives the same tokens in every call, and to equal prompts).
        pad_id: kept for callers of the padded batch this once was; nothing is padded.
        prefill_chunk_size: tokens of one forward (prompt chunks and decode tokens together).
        on_tokens: called after each step with the new token of each row (None for rows without one).
        prefix_cache: a `hybrid.prefix_cache.PrefixCache` of this model: the prompts run on its engine instead,
            each resuming from its longest cached prefix and leaving its own prefix cached.
        speculative: draft up to this many tokens per step with the model's MTP block and verify them
            (`hybrid.serving.speculation`): greedy rows give the tokens of plain decoding, sampled rows the
            same distribution; each `Completion.acceptance_rate` tells the share of its drafts accepted.
            With a prefix_cache, the one it was made with (`PrefixCache(num_speculative_tokens=...)`).
    Returns:
        B `Completion`s (text empty; see `generate` for text); each row's prefill time runs from the call to
        its first token.
    The engine's KV pool is sized for the prompts and at most `RESERVE_AHEAD` new tokens each, and grows as
    needed, so max_new_tokens may be any size (generation runs until a stop id or the limit). Passing the
    config's `max_position_embeddings` gives one `UserWarning` per call and generation goes on (there is no
    positional encoding to run out of; quality past the trained length is not assured).
    Raises:
        ValueError: prompts not a non-empty list of non-empty lists of Python ints (a bool, float or string
            id, named by row and position; see `hybrid.batch.check_prompts`), max_new_tokens not an integer
            >= 1, `sampling` not a `SamplingParams` or a list of B of them, a prompt id outside the model's
            vocabulary [0, config.vocab_size) (named with its row and position), prefill_chunk_size not an
            integer >= 1, a prefix_cache made for another model or another `speculative`, speculative below 0,
            with a model without an MTP block, or with penalties in `sampling` (each drafted position would need
            the penalties before it), or, on a tensor-parallel rank, a sampled row without a seed
            (`hybrid.sampling.check_rank_draws`).
    """
    check_prompts(prompts, model.config.vocab_size)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    sampling = for_call(sampling, len(prompts))  # checked; seeded generators start from their seeds
    check_rank_draws(sampling, model.parallel is not None)
    if speculative and any(p.penalized for p in (sampling if isinstance(sampling, (list, tuple)) else [sampling])):
        raise ValueError("repetition / frequency / presence penalties are not supported with speculative decoding")
    positions = _PositionNote(model.config.max_position_embeddings)
    positions.check(max(len(p) for p in prompts))
    if prefix_cache is not None:  # on the serving engine: every row resumes from its longest cached prefix
        if prefix_cache.model is not model:
            raise ValueError("prefix_cache was made for another model: a PrefixCache serves the model it was made with")
        if speculative != prefix_cache.num_speculative_tokens:
            raise ValueError(f"speculative is {speculative} but the prefix_cache was made with "
                             f"num_speculative_tokens={prefix_cache.num_speculative_tokens}")
        return prefix_cache.generate(prompts, max_new_tokens, sampling, stop_ids, positions.watch(prompts, on_tokens))
    ahead = min(max_new_tokens, RESERVE_AHEAD) + speculative  # the pool grows past this by itself
    blocks = sum(-(-(len(p) + ahead) // DEFAULT_BLOCK_SIZE) for p in prompts)
    engine = Engine(model, num_blocks=blocks, block_size=DEFAULT_BLOCK_SIZE, max_num_seqs=len(prompts),
                    max_num_batched_tokens=prefill_chunk_size, grow=True, num_speculative_tokens=speculative)
    return engine.generate(prompts, sampling, max_new_tokens, stop_ids, positions.watch(prompts, on_tokens))


def utf8_problem(text: str) -> str | None:
    """What keeps `text` from being UTF-8 ("byte 0xff at character 2" for a byte Python kept as a surrogate,
    "character '\\ud800' at character 0" for a lone surrogate), or None when it encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character {text[e.start]!r}"
        return f"{what} at character {e.start}"
    return None


def _check_texts(prompts) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str or a list of str, got {prompts!r:.80}")
    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            hint = " (decode bytes first)" if isinstance(p, (bytes, bytearray)) else ""
            raise TypeError(f"prompts[{i}] must be a str, got {type(p).__name__} {p!r:.80}{hint}")
        problem = utf8_problem(p)
        if problem:
            raise ValueError(f"prompts[{i}] is not valid UTF-8: {problem}")
    return list(prompts)


class _TextStream:
    """Incremental detokenisation per row: emit the new text suffix, hold back an incomplete character."""

    def __init__(self, tokenizer, rows: int, on_text: Callable[[int, str], None], stop_ids):
        self.tokenizer, self.on_text, self.stop_ids = tokenizer, on_text, set(stop_ids)
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.sent = [""] * rows

    def __call__(self, tokens: list[int | None]) -> None:
        for row, t in enumerate(tokens):
            if t is None or t in self.stop_ids:
                continue
            self.ids[row].append(t)
            text = self.tokenizer.decode(self.ids[row])
            if text.endswith("\ufffd"):
                continue
            self._emit(row, text)

    def finish(self, texts: list[str]) -> None:
        """Emit whatever was held back (an incomplete character at the very end)."""
        for row, text in enumerate(texts):
            self._emit(row, text)

    def _emit(self, row: int, text: str) -> None:
        if text.startswith(self.sent[row]) and len(text) > len(self.sent[row]):
            self.on_text(row, text[len(self.sent[row]):])
            self.sent[row] = text


def generate(
    model: HybridForCausalLM,
    tokenizer,
    prompts: str | list[str],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    chat: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    speculative: int = 0,
    prefix_cache: "PrefixCache | None" = None,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    **chat_kwargs,
) -> list[Completion]:
    """Generate text for one prompt or a batch of prompts.

    Args:
        prompts: a string or a list of strings (run together; each row independent, as it runs alone).
        speculative: draft this many tokens per step with the model's MTP block and verify them
            (`hybrid.serving.speculation`; the output distribution is unchanged).
        prefix_cache: reuse and extend the cached state of earlier prompts' prefixes
            (`hybrid.prefix_cache.PrefixCache`, made with `num_speculative_tokens=speculative`).
        chat: wrap each prompt as a user message and render the checkpoint's chat template
            (`chat_kwargs`, e.g. `enable_thinking=False`, reach the template).
        on_text: streaming callback `(row, new_text)` called as text is produced.
        repetition_penalty, frequency_penalty, presence_penalty: see `hybrid.sampling.SamplingParams`
            (vLLM's semantics; not with `speculative`).
    Returns:
        A list of `Completion`s, one per prompt, with `.text`, `.token_ids`, `.finish_reason` (and
        `.acceptance_rate` of the drafts when speculative).
    Raises:
        TypeError: prompts not a str or a list of str (bytes included; named with their index).
        ValueError: no prompts, a prompt that is not UTF-8 (a lone surrogate, or a byte Python kept as one:
            named with its index and the byte), max_new_tokens not an integer >= 1, speculative without an MTP
            block or with penalties; a sampling number out of range or of the
            wrong type (temperature negative or not finite, top_p outside (0, 1], top_k below -1, a penalty out of range; see
            `SamplingParams`: temperature below 1e-5 is greedy, top_k 0 or -1 no limit); a prompt token id
            outside the model's vocabulary (see `generate_ids`).
    """
    prompts = _check_texts(prompts)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    sampling = SamplingParams(temperature, top_k, top_p, seed, repetition_penalty=repetition_penalty,
                              frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)  # checked first
    if chat:
        ids = [tokenizer.encode_chat([{"role": "user", "content": p}], **chat_kwargs) for p in prompts]
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    stop_ids = tokenizer.stop_ids
    stream = _TextStream(tokenizer, len(ids), on_text, stop_ids) if on_text else None
    completions = generate_ids(model, ids, max_new_tokens, sampling, stop_ids, tokenizer.pad_token_id,
                               on_tokens=stream, prefix_cache=prefix_cache, speculative=speculative)
    for c in completions:
        body = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        c.text = tokenizer.decode(body)
    if stream is not None:
        stream.finish([c.text for c in completions])
    return completions
