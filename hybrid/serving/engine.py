"""The serving engine: continuous batching of many requests over paged KV blocks and Mamba state slots.

    engine = Engine(model, num_blocks=2048, max_num_seqs=16)
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0.7, seed=1), max_tokens=64)
    while engine.has_unfinished():
        for out in engine.step():          # one forward over every running sequence
            print(out.request_id, out.new_token_ids, out.finish_reason)

Each `step` asks the scheduler (`hybrid.serving.scheduler`) which sequences run with how many tokens,
packs all of their new tokens into one row with no padding (decode tokens and prompt chunks together), runs
one forward on a `PagedCache` over the two pools (`BlockPool`, `StateSlots`), samples the next token of
every sequence that reached its end with that request's own `SamplingParams` (its own seeded generator;
with `logprobs` set, also the token's log-probabilities, `token_logprobs`), and frees a request's blocks
and slot the moment it finishes or is aborted. A request gives the same tokens as `hybrid.generate_ids`
run on it alone (tests/test_engine.py).
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid.batch import check_max_new_tokens, check_prompt
from hybrid.model import HybridForCausalLM
from hybrid.sampling import Completion, PenaltyState, SamplingParams, apply_penalties, for_call, sample
from hybrid.serving.blocks import BlockPool, GrowingBlockPool
from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE
from hybrid.serving import prefix_file
from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
from hybrid.serving.prefix import DEFAULT_MAX_BYTES, DEFAULT_SNAPSHOT_INTERVAL, PrefixCaching
from hybrid.serving.request import Request, RequestOutput, Status, TokenLogprobs
from hybrid.serving.scheduler import Scheduler
from hybrid.serving.slots import StateSlots

DEFAULT_NUM_BLOCKS = 2048
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # tokens per forward (as generate's prefill chunk)


def _check_size(name: str, value) -> None:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r:.80}")


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i's `TokenLogprobs`: the log-probability of its sampled token `token_ids[i]` and of its `ks[i]`
    most likely tokens (None where `ks[i]` is None) from logits [B, V]. The raw model distribution:
    log_softmax of the logits before temperature, top-k and top-p (see `SamplingParams.logprobs`);
    computed only for the rows that ask, nothing at all when none does."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(ks)
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logprobs.device))[:, 0]
    top = logprobs.topk(min(max(ks[i] for i in rows), logprobs.shape[-1]), dim=-1)
    chosen, top_values, top_ids = chosen.tolist(), top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:ks[i]], top_values[j][:ks[i]])
    return out


@dataclass
class StepStats:
    """The last forward: sequences, tokens packed (every one a real token: there is no padding), and how
    many of them were decode tokens."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_decode_tokens: int = 0


class Engine:
    """Continuous batching over one model (see the module docstring).

    Args:
        model: the model to serve (any dtype or packed format; its device holds the pools).
        num_blocks: KV blocks in the pool, allocated at start (`block_size` tokens each, every attention
            layer); sized from a memory budget by `hybrid.serving.capacity.plan`.
        max_num_seqs: state slots and the most requests running at once.
        max_num_batched_tokens: tokens per forward (decode tokens and prompt chunks together; a prompt chunk may
            run up to max_num_seqs - 1 tokens past it to end its stretch: `hybrid.serving.scheduler`).
        max_model_len: the most tokens (prompt and output) of one request; default and maximum: what the
            KV pool holds (`num_blocks * block_size`), so every request fits the pool alone.
        prefix_caching: share the KV blocks of common prefixes across requests and resume from Mamba
            snapshots (`hybrid.serving.prefix`), taken every `snapshot_interval` prompt tokens and at each
            prompt's end within `prefix_cache_bytes`.
        grow: the KV pool is a `GrowingBlockPool` (it grows, at least doubling, when it runs out, instead of
            preempting) and requests have no length limit: for one user's generation calls (`generate_ids`,
            `hybrid.prefix_cache.PrefixCache`), not a server.
    Raises:
        ValueError: a size that is not an integer >= 1 (named), max_model_len past what the pool holds or
            below 2, or a snapshot_interval that is not a multiple of block_size.
    """

    def __init__(self, model: HybridForCausalLM, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len: int | None = None,
                 prefix_caching: bool = False, snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
                 prefix_cache_bytes: int = DEFAULT_MAX_BYTES, grow: bool = False):
        self.model = model
        config = model.cache_config  # a rank's KV heads and Mamba state under tensor parallelism
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("snapshot_interval", snapshot_interval)):
            _check_size(name, value)
        if max_model_len is not None:
            _check_size("max_model_len", max_model_len)
        if not (isinstance(prefix_cache_bytes, numbers.Integral) and not isinstance(prefix_cache_bytes, bool)
                and prefix_cache_bytes >= 0):
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {prefix_cache_bytes!r:.80}")
        self.blocks = (GrowingBlockPool if grow else BlockPool)(config, num_blocks, block_size, model.dtype,
                                                                 model.device)
        self.slots = StateSlots(config, max_num_seqs, model.dtype, model.device)
        pool_tokens = num_blocks * block_size
        self.max_model_len = (None if grow else pool_tokens) if max_model_len is None else max_model_len
        if self.max_model_len is not None and not (2 <= self.max_model_len and (grow or self.max_model_len <= pool_tokens)):
            raise ValueError(f"max_model_len must be in [2, {pool_tokens}] (the tokens {num_blocks} KV blocks of "
                             f"{block_size} hold), got {max_model_len}")
        self.prefix = PrefixCaching(model.identity, self.blocks, snapshot_interval, prefix_cache_bytes) \
            if prefix_caching else None
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs, max_num_batched_tokens, self.prefix)
        self.cache = PagedCache(config, self.blocks, self.slots)
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []  # reported by the next step
        self._times: dict[str, list[float]] = {}  # request id -> [added, first token, last token]

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None, max_tokens: int = 256,
                    stop_ids=(), request_id: str | None = None) -> str:
        """Queue a request; returns its id (default: the next free number). A seeded `sampling` starts from
        its seed (`SamplingParams.fresh`), so the same object gives the same tokens in every request.

        Raises:
            ValueError: a prompt that is not a non-empty list of int ids in the vocabulary, one of
                `max_model_len` tokens or more (no room for a token to generate), max_tokens not an integer
                >= 1, sampling not a `SamplingParams`, stop_ids not a list of int ids, or a request id
                already in use. A refused request leaves nothing behind.
        """
        return self.add_checked(self.check_request(prompt_ids, sampling, max_tokens, stop_ids), request_id)

    def check_request(self, prompt_ids, sampling=None, max_tokens=256, stop_ids=(), where: str = "prompt_ids"):
        """The request's (prompt, sampling, max_tokens, stop ids), checked and normalised for `add_checked`
        (reads only the config and `max_model_len`: a server checks requests on its own threads).

        Raises:
            ValueError: see `add_request` (prompt errors name `where`).
        """
        check_prompt(prompt_ids, self.model.config.vocab_size, where, in_vocabulary=True)
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"{where} has {len(prompt_ids)} tokens; this engine's max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate")
        max_tokens = check_max_new_tokens(max_tokens, "max_tokens")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if not isinstance(stop_ids, (list, tuple, set, frozenset)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stop_ids):
            raise ValueError(f"stop_ids must be a list of int token ids, got {stop_ids!r:.80}")
        return [int(t) for t in prompt_ids], for_call(sampling, 1), max_tokens, frozenset(int(t) for t in stop_ids)

    def add_checked(self, checked, request_id: str | None = None) -> str:
        """Queue a request from `check_request`'s result; returns its id.

        Raises:
            ValueError: a request id already in use.
        """
        prompt_ids, sampling, max_tokens, stop_ids = checked
        if request_id is not None and str(request_id) in self.requests:
            raise ValueError(f"request id {str(request_id)!r} is already in use")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        request_id = str(request_id)
        request = Request(request_id, prompt_ids, sampling, max_tokens, stop_ids, next(self._arrivals))
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._times[request_id] = [time.perf_counter(), math.nan, math.nan]
        return request_id

    def reserve(self, num_seqs: int) -> None:
        """Let `num_seqs` requests run at once (more state slots if needed).

        Raises:
            ValueError: num_seqs not an integer >= 1.
        """
        _check_size("num_seqs", num_seqs)
        self.slots.grow(num_seqs)
        self.scheduler.max_num_seqs = max(self.scheduler.max_num_seqs, num_seqs)

    def abort(self, request_id: str) -> None:
        """Cancel a waiting or running request, freeing its blocks and slot now; the next `step` reports it
        finished with reason "abort" (a finished or unknown id is ignored)."""
        request = self.requests.get(request_id)
        if request is not None and request.status is not Status.FINISHED:
            self.scheduler.finish(request, "abort")
            self._aborted.append(RequestOutput(request_id, [], True, "abort", request.num_cached_tokens))

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs, or an abort is still to be reported by `step`."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ------------------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled sequences; the new token of each request that produced one
        (and the requests that finished, with why; aborted ones since the last step first)."""
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        # requests the prefix cache held whole: nothing to compute, their first token's hidden state was kept
        ready = [r for r, n in scheduled if n == 0]
        scheduled = [(r, n) for r, n in scheduled if n]
        if not scheduled and not ready:
            self.last_step = StepStats()
            return outputs
        ends: list[tuple[Request, torch.Tensor]] = []
        if scheduled:
            self.cache.schedule([ScheduledSeq(r.block_table, r.slot, r.num_computed, n) for r, n in scheduled])
            ids = [t for r, n in scheduled for t in r.all_ids[r.num_computed:r.num_computed + n]]
            hidden = self.model.hidden_states(torch.tensor([ids], device=self.model.device), self.cache)[0]
            if len(ids) == len(scheduled):  # a decode step: every row is a sequence's last
                last_hidden = hidden
            else:
                last = torch.tensor(list(itertools.accumulate(n for _, n in scheduled)), device=hidden.device) - 1
                last_hidden = hidden[last]
            for row, (r, n) in enumerate(scheduled):
                r.num_computed += n
                if r.num_computed == r.num_tokens:
                    ends.append((r, last_hidden[row]))
            if self.prefix is not None:
                self.prefix.after_step(scheduled, self.cache, last_hidden)
        self.last_step = StepStats(len(scheduled), sum(n for _, n in scheduled),
                                   sum(n for r, n in scheduled if r.output_ids and n == 1))
        for r in ready:
            ends.append((r, r.resume_hidden))
            r.resume_hidden = None
        if not ends:
            return outputs
        logits = self.model.logits(torch.stack([h for _, h in ends]))
        tokens = self._sample(logits, [r for r, _ in ends])
        logprobs = token_logprobs(logits, tokens, [r.sampling.logprobs for r, _ in ends])
        now = time.perf_counter()
        for (r, _), token, lp in zip(ends, tokens, logprobs):
            r.output_ids.append(token)
            times = self._times[r.request_id]
            if math.isnan(times[1]):
                times[1] = now
            times[2] = now
            at_limit = self.max_model_len is not None and r.num_tokens >= self.max_model_len
            reason = "stop" if token in r.stop_ids else "length" if len(r.output_ids) >= r.max_tokens or at_limit else None
            if reason is not None:
                self.scheduler.finish(r, reason)
            outputs.append(RequestOutput(r.request_id, [token], reason is not None, reason, r.num_cached_tokens,
                                         None if lp is None else [lp]))
        return outputs

    # ------------------------------------------------------------------------------------------ prefix cache file
    def save_prefix_cache(self, path) -> None:
        """Write the prefix cache's named blocks and snapshots to `path` (`hybrid.serving.prefix_file`).

        Raises:
            ValueError: the engine was made without prefix_caching.
        """
        prefix_file.save(self._require_prefix(), path)

    def load_prefix_cache(self, path) -> int:
        """Add the blocks and snapshots saved in `path` (into free blocks, as many as fit); returns the
        snapshots added.

        Raises:
            ValueError: the engine was made without prefix_caching.
            PrefixCacheFileError: see `hybrid.serving.prefix_file.load` (nothing is added then).
        """
        return prefix_file.load(self._require_prefix(), self.slots, path, self.model.config.vocab_size,
                                hidden_size=self.model.config.hidden_size)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """The next token of each request from its row of logits [n, V]: the greedy rows without penalties by
        one argmax over all rows, every other row with its own parameters and generator."""
        plain = [not r.sampling.temperature and not r.sampling.penalized for r in requests]
        argmax = logits.argmax(dim=-1).tolist() if any(plain) else None
        return [argmax[j] if plain[j] else
                int(sample(apply_penalties(logits[j:j + 1], r.sampling, [r.prompt_ids], [r.output_ids],
                                           [self._penalties(r, logits)]), r.sampling))
                for j, r in enumerate(requests)]

    @staticmethod
    def _penalties(r: Request, logits: torch.Tensor) -> PenaltyState | None:
        """Request `r`'s penalty statistics, made at its first sampled token (None when not penalized)."""
        if r.penalties is None and r.sampling.penalized:
            r.penalties = PenaltyState(r.prompt_ids, logits.device)
        return r.penalties

    def _require_prefix(self) -> PrefixCaching:
        if self.prefix is None:
            raise ValueError("this engine was made without prefix_caching")
        return self.prefix

    # ------------------------------------------------------------------------------------------ batch use
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 max_tokens: int = 256, stop_ids=(),
                 on_tokens: Callable[[list[int | None]], None] | None = None) -> list[Completion]:
        """Run `prompts` (token id lists) to completion together; one `Completion` per prompt, in order
        (text empty). `sampling`: one for all (each request then draws from its own generator started at
        its seed, as a server's per-request seed) or one per prompt. `on_tokens` is called after each step
        that produced tokens, with each prompt's new token (None for the others). Every prompt is checked
        before any is queued (errors name `prompts[i]`). Outputs of requests added by other callers are
        consumed by these steps: mix the two only through `step`.

        Raises:
            ValueError: see `add_request`; or `sampling` a list of another length than `prompts`.
        """
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token id lists, got {prompts!r:.80}")
        per = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} sampling parameter sets for {len(prompts)} prompts")
        checked = [self.check_request(p, s, max_tokens, stop_ids, f"prompts[{i}]") for i, (p, s) in enumerate(zip(prompts, per))]
        ids = [self.add_checked(c) for c in checked]
        row_of = {rid: row for row, rid in enumerate(ids)}
        try:
            while any(self.requests[i].status is not Status.FINISHED for i in ids):
                outputs = self.step()
                if on_tokens is not None and outputs:
                    tokens: list[int | None] = [None] * len(ids)
                    for out in outputs:
                        if out.request_id in row_of:
                            tokens[row_of[out.request_id]] = out.new_token_ids[0]
                    on_tokens(tokens)
            return [self.completion(i) for i in ids]
        finally:
            for i in ids:
                self.abort(i)
                self.release(i)

    def completion(self, request_id: str) -> Completion:
        """The `Completion` of a finished request (prefill time: from its arrival to its first token).

        Raises:
            ValueError: an unknown request id, or a request that has not finished.
        """
        r = self.requests.get(request_id)
        if r is None:
            raise ValueError(f"unknown request id {request_id!r}")
        if r.status is not Status.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        added, first, last = self._times[request_id]
        return Completion(list(r.output_ids), r.finish_reason or "length", len(r.prompt_ids), first - added, last - first,
                          cached_tokens=r.num_cached_tokens)

    def release(self, request_id: str) -> None:
        """Forget a finished request (a server calls this once it has sent the result).

        Raises:
            ValueError: the request has not finished (abort it first).
        """
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status is not Status.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished; abort it first")
        del self.requests[request_id]
        del self._times[request_id]
