"""Choosing the next token: sampling parameters with a random generator per row, the filtered distribution,
the draw; and the `Completion` a generation returns. Plain, speculative and (later) served generation all
use this module; none of them imports another.

    probs = filtered_probs(logits, params)     softmax(logits / temperature), min-p, top-k, then top-p, renormalised
    ids = sample(logits, params)               argmax when temperature is 0 (or < 1e-5), else one draw per row,
                                               on the logits' device with no read back to the host
    logits = apply_penalties(logits, params, prompts, outputs)   repetition / frequency / presence, before both
    states = penalty_states(params, prompts)   kept across a generation's steps: apply_penalties(..., states)
                                               counts each new token once instead of the whole prompt and output

`params` is one `SamplingParams` for the whole batch (one generator draws every row), or a list with one per
row (each row draws from its own generator, so a row gives the same tokens in any batch as alone).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


# Temperatures below this decode greedily (vLLM's `_SAMPLING_EPS`): dividing by them overflows the logits.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """temperature 0 (or None, or below `SAMPLING_EPS`) is greedy (ties: lowest id); min_p, top_k and top_p
    filter before sampling, in that order (vLLM's): min_p drops the tokens less likely than min_p times the
    most likely one (0 is none), top_k (0 or -1, like None, is no limit) keeps the k most likely, top_p the
    smallest prefix reaching that mass; `seed` makes the draws reproducible: each
    generation call (`generate_ids`, `generate`) starts again from it (`fresh`), so the same object gives the
    same tokens in every call; `sample` used directly draws on from this object's own generator.

    logprobs: with an integer k >= 0, the serving engine reports each sampled token's log-probability and
    the k most likely tokens' (vLLM's `SamplingParams.logprobs`; None, the default, computes nothing). They
    are the model's raw distribution, log_softmax of the logits before temperature, top-k and top-p (vLLM's
    default, `logprobs_mode="raw_logprobs"`), so a token's number does not depend on how it was drawn.

    Penalties (vLLM's semantics; `apply_penalties` applies them to the logits before temperature and
    filtering, and before greedy's argmax): `repetition_penalty` (> 0; 1 is none) divides the positive logits
    and multiplies the others of every token seen in the prompt or the output (CTRL's penalty, as
    transformers' `RepetitionPenaltyLogitsProcessor`); `frequency_penalty` and `presence_penalty` (OpenAI's,
    in [-2, 2]; 0 is none) subtract, from each token's logit, the penalty times the number of times it was
    generated, and the penalty once if it was generated at all (the output only, not the prompt).

    Raises:
        ValueError: temperature negative, not finite or not a number, top_k not a positive integer (or 0 / -1),
            top_p not a number in (0, 1], min_p not a number in [0, 1], logprobs not an integer >= 0 (or
            None), a seed that is not an integer torch's generator can take, repetition_penalty not a finite
            number > 0, or frequency_penalty / presence_penalty not a number in [-2, 2] (bools are refused
            everywhere; the value is named with its repr, so a string shows its quotes).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    generator: torch.Generator | None = field(default=None, repr=False)
    # the seed's generators on other devices than the CPU (`generator_on`), made at their first draw
    _device_generators: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        t = 0.0 if self.temperature is None else self.temperature
        if not (_real(t) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        self.temperature = 0.0 if t < SAMPLING_EPS else float(t)
        k = self.top_k
        if k is not None and not (_integer(k) and k >= -1):
            raise ValueError(f"top_k must be a positive integer, or 0 or -1 for no limit, got {k!r}")
        self.top_k = None if k is None or k in (0, -1) else int(k)
        if self.top_p is not None and not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        m = 0.0 if self.min_p is None else self.min_p
        if not (_real(m) and 0 <= m <= 1):
            raise ValueError(f"min_p must be a number in [0, 1] (0: none), got {m!r}")
        self.min_p = float(m)
        if self.logprobs is not None and not (_integer(self.logprobs) and self.logprobs >= 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        r = self.repetition_penalty
        if not (_real(r) and math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {r!r}")
        self.repetition_penalty = float(r)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (_real(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2] (0: none), got {v!r}")
            setattr(self, name, float(v))
        if self.seed is not None:
            if not (_integer(self.seed) and -2**63 <= self.seed < 2**64):
                raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
            self.generator = torch.Generator().manual_seed(int(self.seed))

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (`apply_penalties` is then not the identity)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def generator_on(self, device: torch.device | str) -> torch.Generator | None:
        """The seeded generator to draw with on `device` (None when unseeded: torch's default one there): on the
        CPU `generator`; elsewhere one made from the same seed at its first use (a device draws from a
        generator of its own, so no draw leaves the device; seeded tokens are reproducible per device)."""
        if self.seed is None:
            return None
        device = torch.device(device)
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device).manual_seed(int(self.seed))
        return self._device_generators[device]

    def fresh(self) -> "SamplingParams":
        """These parameters for a new generation call: a seeded one starts again from its seed (its own new
        generator), so one object gives the same tokens in every call; an unseeded one is returned as is."""
        return dataclasses.replace(self) if self.seed is not None else self


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


Sampling = SamplingParams | Sequence[SamplingParams]


def _per_row(params: Sampling, rows: int) -> Sequence[SamplingParams] | None:
    """The list of per-row params, or None for one `SamplingParams` shared by the batch.

    Raises:
        ValueError: `params` is neither a `SamplingParams` nor a list / tuple of them, or has not `rows` of them.
    """
    if isinstance(params, SamplingParams):
        return None
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling must be a SamplingParams or a list of one per row, got {type(params).__name__}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling[{i}] must be a SamplingParams, got {type(p).__name__}")
    if len(params) != rows:
        raise ValueError(f"{len(params)} sampling parameter sets for {rows} rows")
    return params


def for_call(params: Sampling | None, rows: int) -> Sampling:
    """The sampling parameters of one generation call over `rows` rows: checked (see `_per_row`), default
    greedy, each seeded `SamplingParams` starting again from its seed (`SamplingParams.fresh`), so a call is
    reproducible whatever earlier calls drew with the same objects.

    Raises:
        ValueError: see `_per_row`.
    """
    if params is None:
        return SamplingParams()
    rows_params = _per_row(params, rows)
    if rows_params is None:
        return params.fresh()
    return [p.fresh() for p in rows_params]


def check_rank_draws(params: Sampling, sharded: bool) -> None:
    """Under tensor parallelism (`sharded`) every rank draws its own tokens: the logits are all-gathered, the
    same bytes on every rank, so the same generator draws the same token everywhere with no message per token
    (rank 0 sampling and broadcasting would cost one round trip per token, the latency a multi-host run can least
    afford). That holds only if every rank's generator starts from the same seed: a sampled row without one is
    refused (greedy rows need none).

    Raises:
        ValueError: a row with temperature > 0 and no seed, when `sharded`.
    """
    if not sharded:
        return
    rows = list(params) if isinstance(params, (list, tuple)) else [params]
    if any(p.temperature and p.seed is None for p in rows):
        raise ValueError("sampling under tensor parallelism needs a seed, the same on every rank (each rank draws "
                         "from the same all-gathered logits with its own generator); pass seed=..., or sample "
                         "greedily (temperature 0)")


class PenaltyState:
    """A penalized row's token statistics, brought up to date with each new output token (`update`), so that
    applying its penalties costs a few small index operations a step; rebuilt from the whole prompt and output
    at every step they cost O(prompt + output) Python work, on every step of every penalized request a server
    runs (docs/perf-log.md#penalty-state). Sparse, like that recount: only the ids seen are touched (the same
    operations over the whole vocabulary were slower than the recount at a large vocabulary: same entry).

    seen_ids [S] int64: the distinct ids of the prompt and the output so far (the repetition penalty's set);
    output_ids [U] int64 and output_counts [U] int64: the output's distinct ids and their occurrences
    (frequency and presence); consumed: the outputs counted so far.
    """

    def __init__(self, prompt_ids: Sequence[int], device: torch.device | str | None = None):
        self._seen = set(prompt_ids)
        self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
        self._where: dict[int, int] = {}  # output id -> its position in output_ids
        self.output_ids = torch.zeros(0, dtype=torch.long, device=device)
        self.output_counts = torch.zeros(0, dtype=torch.long, device=device)
        self.consumed = 0

    def update(self, output_ids: Sequence[int]) -> None:
        """Count the ids of `output_ids` past the `consumed` first (the row's outputs so far: they only grow).

        Raises:
            ValueError: `output_ids` is shorter than what was already counted.
        """
        if len(output_ids) < self.consumed:
            raise ValueError(f"a penalty state that counted {self.consumed} output tokens got {len(output_ids)}: "
                             "a row's outputs only grow (one state per row and generation)")
        new = [int(t) for t in output_ids[self.consumed:]]
        if not new:
            return
        self.consumed = len(output_ids)
        unseen = sorted({t for t in new if t not in self._seen})
        if unseen:
            self._seen.update(unseen)
            self.seen_ids = torch.cat([self.seen_ids, self.seen_ids.new_tensor(unseen)])
        first = [t for t in dict.fromkeys(new) if t not in self._where]
        for t in first:
            self._where[t] = len(self._where)
        if first:
            self.output_ids = torch.cat([self.output_ids, self.output_ids.new_tensor(first)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(len(first))])
        self.output_counts.index_add_(0, self.output_ids.new_tensor([self._where[t] for t in new]),
                                      self.output_counts.new_ones(len(new)))


def penalty_states(params: Sampling, prompts: Sequence[Sequence[int]],
                   device: torch.device | str | None = None) -> list[PenaltyState | None] | None:
    """One `PenaltyState` per penalized row of `params` (None for the others), or None when no row is
    penalized: the `states` of `apply_penalties` for a generation over `prompts`."""
    rows = _per_row(params, len(prompts)) or [params] * len(prompts)
    if not any(p.penalized for p in rows):
        return None
    return [PenaltyState(prompt, device) if p.penalized else None for p, prompt in zip(rows, prompts)]


def apply_penalties(logits: torch.Tensor, params: Sampling, prompts: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]],
                    states: Sequence[PenaltyState | None] | None = None) -> torch.Tensor:
    """The logits [B, V] with each row's penalties applied (see `SamplingParams`), for rows whose prompt
    token ids are `prompts[b]` and generated ids so far `outputs[b]`; fp32 where a row is penalized, the
    input itself when no row is. The same for one row in any batch (vLLM's `apply_penalties`).

    `states` (from `penalty_states`, kept across the steps of one generation): each penalized row's
    statistics, brought up to date with `outputs[b]` here, instead of recounting its prompt and outputs; the
    result is the same, bit for bit.

    Raises:
        ValueError: `params` a list of another length than the rows (see `_per_row`); a state given outputs
            shorter than it counted (see `PenaltyState.update`).
    """
    B, V = logits.shape
    rows = _per_row(params, B) or [params] * B
    if not any(p.penalized for p in rows):
        return logits
    out = logits.float().clone()
    for b, p in enumerate(rows):
        if not p.penalized:
            continue
        row = out[b]
        state = states[b] if states is not None else None
        if state is not None:
            state.update(outputs[b])
        if p.repetition_penalty != 1:
            seen = state.seen_ids if state is not None else torch.tensor(
                sorted(set(prompts[b]) | set(outputs[b])), dtype=torch.long, device=row.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if outputs[b] and (p.frequency_penalty or p.presence_penalty):
            if state is not None:  # the same per-entry arithmetic as below, on the entries it changes (count > 0)
                ids, counts = state.output_ids, state.output_counts
                row[ids] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            else:
                counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.long), minlength=V)[:V].to(row.device)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def _column(values: list, like: torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """One number per row as a broadcastable [B, 1] tensor on `like`'s device, or the number itself when every
    row has the same (the common case: no tensor to copy to the device)."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)[:, None]


def _filtered_logits(logits: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, V] scaled by each row's temperature (a greedy row's by 1: its draw is not used) with the
    tokens that min_p, top_k and top_p drop set to -inf, fp32; all rows at once, each with its own values."""
    logits = logits.float() / _column([p.temperature or 1.0 for p in rows], logits, torch.float32)
    V = logits.shape[-1]
    if any(p.min_p > 0 for p in rows):
        probs = logits.softmax(dim=-1)
        floor = _column([p.min_p for p in rows], logits, torch.float32) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    ks = [min(p.top_k or V, V) for p in rows]
    if min(ks) < V:
        top = logits.topk(max(ks), dim=-1).values
        k = _column(ks, logits, torch.long)
        kth = top[:, k - 1:k] if isinstance(k, int) else top.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    tops = [p.top_p if p.top_p is not None and p.top_p < 1 else math.inf for p in rows]
    if min(tops) < math.inf:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > _column(tops, logits, torch.float32)  # the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _rows(params: Sampling, batch: int) -> Sequence[SamplingParams]:
    return _per_row(params, batch) or [params] * batch


def filtered_probs(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    """The distribution tokens are drawn from: softmax(logits / temperature) restricted by min_p, then to the
    top-k tokens, then to the smallest top-p prefix, renormalised. logits [B, V] -> probs [B, V] fp32; a greedy
    row (temperature 0) is the one-hot of its argmax."""
    rows = _rows(params, logits.shape[0])
    greedy = [not p.temperature for p in rows]
    if all(greedy):
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = _filtered_logits(logits, rows).softmax(dim=-1)
    if any(greedy):
        probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(dim=-1), logits.shape[-1]).float()
    return probs


def sample(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    """Next token ids [B] int64 from logits [B, V], on the logits' device; nothing is read back to the host, so
    a caller takes a step's ids with one transfer.

    A sampled row's token is the argmax of its filtered probabilities divided by exponential noise (the
    exponential race: token i wins with probability p_i; vLLM's sampler, which avoids `torch.multinomial`'s
    device synchronisation). Each row's noise comes from its own generator on that device
    (`SamplingParams.generator_on`; one shared `SamplingParams` draws every row from its one generator, an
    unseeded row from torch's default one), so a seeded row gives the same token in any batch as alone. All rows
    are filtered as one batch, not row by row (docs/perf-log.md#device-sampler).

    Raises:
        ValueError: `params` a list of another length than the rows (see `_per_row`).
    """
    rows = _rows(params, logits.shape[0])
    greedy = [not p.temperature for p in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    probs = _filtered_logits(logits, rows).softmax(dim=-1)
    noise = torch.empty_like(probs)
    if isinstance(params, SamplingParams):
        noise.exponential_(generator=params.generator_on(logits.device))
    else:
        generators = [None if g else p.generator_on(logits.device) for p, g in zip(rows, greedy)]
        if any(g is None for g, greedy_row in zip(generators, greedy) if not greedy_row):
            noise.exponential_()  # the unseeded rows' draws
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
    # an exponential draw of exactly 0 (possible in float) must not divide a probability of 0 into NaN
    drawn = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return torch.where(_column(greedy, logits, torch.bool)[:, 0], logits.argmax(dim=-1), drawn) if any(greedy) \
        else drawn


@dataclass
class Completion:
    """One generated continuation.

    token_ids: the generated ids, the stop token included when `finish_reason == "stop"`.
    text: the decoded continuation without special tokens and without the stop token.
    finish_reason: "stop" (a stop id was produced), "length" (`max_new_tokens` reached) or, on the serving
    engine, "abort" (cancelled).
    acceptance_rate: with speculative decoding, the share of drafted tokens the model accepted.
    cached_tokens: prompt tokens taken from a prefix cache instead of computed.
    prefill_seconds / decode_seconds: wall time of the batch's prefill (up to the first token) and of the
    decode steps after it; the rates count this row's tokens (the prefill rate its computed prompt tokens).
    """

    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    text: str = ""
    acceptance_rate: float | None = None
    cached_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed per second of prefill: those taken from a prefix cache (`cached_tokens`)
        are not counted, as they were not computed."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode steps (the first token comes from the prefill); None if none ran."""
        steps = len(self.token_ids) - 1
        if steps < 1:
            return None
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("inf")
