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
from collections.abc import Callable, Sequence

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
from hybrid.serving.speculation import Computed, MTPDrafter, SpeculativeStats, accept

DEFAULT_NUM_BLOCKS = 2048
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # tokens per forward (as generate's prefill chunk)


def _check_size(name: str, value, minimum: int = 1) -> None:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r:.80}")


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
        num_speculative_tokens: draft up to this many tokens per request and step with the model's MTP block
            and verify them in the next step (`hybrid.serving.speculation`; 0: off). Greedy requests give the
            tokens of plain decoding, sampled ones the same distribution; `speculative_stats` counts drafts.
        decode_buckets: pad each decode step (every sequence one token, none verifying drafts) of n sequences
            to the smallest of these sizes that holds n, with padding rows (token 0, in a state slot and a KV
            block reserved for them, their outputs dropped): the fixed shapes a CUDA graph replays. A step
            larger than every bucket runs unpadded. None (the default): no padding.
    Raises:
        ValueError: a size that is not an integer >= 1 (named), max_model_len past what the pool holds or
            below 2, a snapshot_interval that is not a multiple of block_size, num_speculative_tokens below 0,
            speculative decoding with a model it cannot draft for (`MTPDrafter`), or a decode bucket that is
            not an integer >= 1.
    """

    def __init__(self, model: HybridForCausalLM, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len: int | None = None,
                 prefix_caching: bool = False, snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
                 prefix_cache_bytes: int = DEFAULT_MAX_BYTES, grow: bool = False, num_speculative_tokens: int = 0,
                 decode_buckets: Sequence[int] | None = None):
        self.model = model
        config = model.cache_config  # a rank's KV heads and Mamba state under tensor parallelism
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("snapshot_interval", snapshot_interval)):
            _check_size(name, value)
        if max_model_len is not None:
            _check_size("max_model_len", max_model_len)
        _check_size("prefix_cache_bytes", prefix_cache_bytes, minimum=0)
        _check_size("num_speculative_tokens", num_speculative_tokens, minimum=0)
        for size in decode_buckets or ():
            _check_size("a decode bucket", size)
        self.decode_buckets = sorted(set(decode_buckets or ()))
        padding = 1 if self.decode_buckets else 0  # the padding rows' own slot and block, beside the requests'
        self.blocks = (GrowingBlockPool if grow else BlockPool)(config, num_blocks + padding, block_size, model.dtype,
                                                                 model.device, mtp=num_speculative_tokens > 0)
        self.slots = StateSlots(config, max_num_seqs + padding, model.dtype, model.device)
        self._padding = ScheduledSeq([self.blocks.allocate()], self.slots.allocate(), 0, 1) if padding else None
        pool_tokens = num_blocks * block_size
        self.max_model_len = (None if grow else pool_tokens) if max_model_len is None else max_model_len
        if self.max_model_len is not None and not (2 <= self.max_model_len and (grow or self.max_model_len <= pool_tokens)):
            raise ValueError(f"max_model_len must be in [2, {pool_tokens}] (the tokens {num_blocks} KV blocks of "
                             f"{block_size} hold), got {max_model_len}")
        self.prefix = PrefixCaching(model.identity, self.blocks, snapshot_interval, prefix_cache_bytes) \
            if prefix_caching else None
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs, max_num_batched_tokens, self.prefix)
        self.cache = PagedCache(config, self.blocks, self.slots)
        self.drafter = MTPDrafter(model, self.blocks, self.slots, num_speculative_tokens) \
            if num_speculative_tokens else None
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
        """Run one forward over the scheduled sequences; the new tokens of each request that produced some
        (and the requests that finished, with why; aborted ones since the last step first)."""
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        # requests the prefix cache held whole: nothing to compute, their first token's hidden state was kept
        ready = [r for r, n in scheduled if n == 0]
        scheduled = [(r, n) for r, n in scheduled if n]
        if not scheduled and not ready:
            self.last_step = StepStats()
            return outputs
        for r, n in scheduled:  # a token budget that cut a verification short verifies fewer drafts
            if r.draft_ids and n < 1 + len(r.draft_ids):
                del r.draft_ids[n - 1:], r.draft_probs[n - 1:]
        # each request that samples, with the hidden states [m, H] it samples from (its last position, or its
        # last token and each draft) and its row in the packed forward (None: held whole by the prefix cache)
        ends: list[tuple[Request, torch.Tensor, int | None]] = []
        hidden = last_hidden = None
        if scheduled:
            seqs = [ScheduledSeq(r.block_table, r.slot, r.num_computed, n, bool(r.draft_ids)) for r, n in scheduled]
            ids = [t for r, n in scheduled for t in r.step_ids(n)]
            pad = self._decode_padding(seqs)
            self.cache.schedule(seqs + [self._padding] * pad)
            hidden = self.model.hidden_states(torch.tensor([ids + [0] * pad]), self.cache)[0]  # checked on the host
            hidden = hidden[:len(ids)] if pad else hidden
            if len(ids) == len(scheduled):  # a decode step: every row is a sequence's last
                last_hidden = hidden
            else:
                last = torch.tensor(list(itertools.accumulate(n for _, n in scheduled)), device=hidden.device) - 1
                last_hidden = hidden[last]
            start = 0
            for row, (r, n) in enumerate(scheduled):
                if r.draft_ids:
                    ends.append((r, hidden[start:start + n], row))
                elif r.num_computed + n == r.num_tokens:
                    ends.append((r, last_hidden[row][None], row))
                r.num_computed += n  # a verification's rejected drafts are taken back by `_accept`
                start += n
        for r in ready:
            ends.append((r, r.resume_hidden[None], None))
            r.resume_hidden = None
        new_tokens, kept = self._sample_ends(ends)
        for (r, _, row), tokens in zip(ends, new_tokens):
            if row is not None and r.draft_ids:
                self._accept(r, row, len(tokens))
        reasons = self._append(ends, new_tokens)
        if self.drafter is not None:  # before the prefix cache's snapshots, which keep the MTP block's keys too
            ending = {id(r) for (r, _, _), reason in zip(ends, reasons) if reason is not None}
            self.drafter.propose(self._computed(scheduled, hidden, kept, ends, ending), self._draft_budget,
                                 self.scheduler.reserve_positions)
        if scheduled and self.prefix is not None:
            self.prefix.after_step([(r, kept.get(id(r), n)) for r, n in scheduled], self.cache, last_hidden)
        for r, _ in scheduled:
            r.resume_hidden = None  # a partial prefix hit's: the drafter's (`_computed`)
        self.last_step = StepStats(len(scheduled), sum(n for _, n in scheduled),
                                   sum(n for r, n in scheduled if r.output_ids and n == 1))
        return outputs + self._finish(ends, new_tokens, reasons)

    def _decode_padding(self, seqs: list[ScheduledSeq]) -> int:
        """The padding rows a step of `seqs` takes (`decode_buckets`): to the smallest bucket that holds a decode
        step (every sequence one token, none verifying); 0 for any other step."""
        if not self.decode_buckets or any(s.num_tokens != 1 or s.verify for s in seqs):
            return 0
        return next((b - len(seqs) for b in self.decode_buckets if b >= len(seqs)), 0)

    def _sample_ends(self, ends) -> tuple[list[list[tuple[int, torch.Tensor]]], dict[int, int]]:
        """Each end's new tokens with the logits row of each (`_sample` for one position; `accept` for a
        verification), and the positions each verifying request keeps (by `id`: its accepted drafts and its
        last token)."""
        if not ends:
            return [], {}
        logits = self.model.logits(torch.cat([h for _, h, _ in ends]))
        firsts = list(itertools.accumulate([0] + [len(h) for _, h, _ in ends]))[:-1]
        plain = [j for j, (_, h, _) in enumerate(ends) if len(h) == 1]
        out: list[list[tuple[int, torch.Tensor]]] = [[] for _ in ends]
        if plain:
            rows = [firsts[j] for j in plain]
            picked = logits if len(rows) == len(logits) else logits[rows]
            for j, token, row in zip(plain, self._sample(picked, [ends[j][0] for j in plain]), rows):
                out[j] = [(token, logits[row])]
        kept: dict[int, int] = {}
        for j, (r, h, _) in enumerate(ends):
            if len(h) > 1:
                p = logits[firsts[j]:firsts[j] + len(h)]
                a, extra = accept(p, r.draft_ids, r.draft_probs, r.sampling)
                out[j] = [(t, p[i]) for i, t in enumerate(r.draft_ids[:a] + [extra])]
                kept[id(r)] = a + 1
                r.num_drafted, r.num_accepted = r.num_drafted + len(r.draft_ids), r.num_accepted + a
                self.drafter.stats.add(len(r.draft_ids), a)
        return out, kept

    def _accept(self, r: Request, row: int, num_tokens: int) -> None:
        """Keep the verifying request `r`'s last token and its first `num_tokens - 1` drafts (row `row` of the
        step): its Mamba states return to just after them, its computed positions end there."""
        self.cache.accept(row, num_tokens)
        r.num_computed -= len(r.draft_ids) + 1 - num_tokens
        r.draft_ids, r.draft_probs = [], []

    def _computed(self, scheduled, hidden, kept, ends, ending: set[int]) -> list[Computed]:
        """The positions the main model computed and kept this step, per request that drafts and is not
        `ending` (by `id`): the drafter's input. A request resumed from the prefix cache also reruns the MTP block at its resume point's last
        position, from the hidden state kept there (the block's keys there were made with the token that
        followed in the request that filled them): in a block of its own (`_own_position`), else not at all
        (and a request the prefix cache held whole then drafts nothing this step)."""
        def wanted(r: Request) -> bool:
            return id(r) not in ending and self.drafter.drafts(r)

        computed, start = [], 0
        for r, n in scheduled:
            m = kept.get(id(r), n)
            if wanted(r):
                past, rows = r.num_computed - m, hidden[start:start + m]
                if r.resume_hidden is not None and self._own_position(r, past - 1):
                    past, rows = past - 1, torch.cat([r.resume_hidden[None], rows])
                computed.append(Computed(r, past, rows))
            start += n
        return computed + [Computed(r, r.num_computed - 1, h) for r, h, row in ends
                           if row is None and wanted(r) and self._own_position(r, r.num_computed - 1)]

    def _own_position(self, r: Request, position: int) -> bool:
        """Whether `r` may write its MTP keys at `position`: the block holding it is its own, or is made so (a
        copy in a free block replaces a block it shares: copy on write)."""
        j = position // self.blocks.block_size
        return not self.blocks.shared(r.block_table[j]) or self.scheduler.own_block(r, j)

    def _append(self, ends, new_tokens) -> list[str | None]:
        """Append each end's new tokens to its request up to a stop id or its length limit (the tokens past
        them dropped from `new_tokens`); why each request ends, or None."""
        reasons = []
        for (r, _, _), tokens in zip(ends, new_tokens):
            reason = None
            for i, (token, _) in enumerate(tokens):
                r.output_ids.append(token)
                at_limit = self.max_model_len is not None and r.num_tokens >= self.max_model_len
                reason = "stop" if token in r.stop_ids else "length" if len(r.output_ids) >= r.max_tokens or at_limit \
                    else None
                if reason is not None:
                    del tokens[i + 1:]
                    break
            reasons.append(reason)
        return reasons

    def _finish(self, ends, new_tokens, reasons) -> list[RequestOutput]:
        """Finish the requests that ended; each end's `RequestOutput` (its log-probabilities when asked: every
        asking request's tokens in one `token_logprobs` call)."""
        asked = [(j, token, row) for j, ((r, _, _), tokens) in enumerate(zip(ends, new_tokens))
                 if r.sampling.logprobs is not None for token, row in tokens]
        logprobs: dict[int, list[TokenLogprobs]] = {}
        if asked:
            got = token_logprobs(torch.stack([row for _, _, row in asked]), [t for _, t, _ in asked],
                                 [ends[j][0].sampling.logprobs for j, _, _ in asked])
            for (j, _, _), lp in zip(asked, got):
                logprobs.setdefault(j, []).append(lp)
        outputs = []
        now = time.perf_counter()
        for j, ((r, _, _), tokens, reason) in enumerate(zip(ends, new_tokens, reasons)):
            if reason is not None:
                self.scheduler.finish(r, reason)
            times = self._times[r.request_id]
            if math.isnan(times[1]):
                times[1] = now
            times[2] = now
            outputs.append(RequestOutput(r.request_id, [t for t, _ in tokens], reason is not None, reason,
                                         r.num_cached_tokens, logprobs.get(j)))
        return outputs

    def _draft_budget(self, r: Request) -> int:
        """How many tokens request `r` may draft for its next step: none unless it decodes next; at most
        `num_speculative_tokens`, and no more than its `max_tokens` and the engine's `max_model_len` leave
        room for beside the token the verification itself adds."""
        if r.status is not Status.RUNNING or r.num_computed != r.num_tokens - 1 or not r.output_ids:
            return 0
        n = min(self.drafter.num_speculative_tokens, r.max_tokens - len(r.output_ids) - 1)
        if self.max_model_len is not None:
            n = min(n, self.max_model_len - r.num_tokens - 1)
        return max(n, 0)

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Drafted and accepted tokens so far (None without speculative decoding)."""
        return None if self.drafter is None else self.drafter.stats

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
        """The next token of each request from its row of logits [n, V]: each row's penalties, then one batched
        draw (`hybrid.sampling.sample`: each row with its own parameters and generator, on the logits' device),
        and one transfer of the n ids to the host."""
        rows = [r.sampling for r in requests]
        if any(p.penalized for p in rows):
            logits = apply_penalties(logits, rows, [r.prompt_ids for r in requests], [r.output_ids for r in requests],
                                     [self._penalties(r, logits) for r in requests])
        return sample(logits, rows).tolist()

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
        its seed, as a server's per-request seed) or one per prompt. `on_tokens` is called for each token a
        step produced, with each prompt's new token (None for the others; a step that verified drafts calls
        it once per accepted token). Every prompt is checked
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
                new = {row_of[out.request_id]: out.new_token_ids for out in outputs if out.request_id in row_of}
                for i in range(max(map(len, new.values()), default=0) if on_tokens is not None else 0):
                    on_tokens([new[row][i] if row in new and i < len(new[row]) else None for row in range(len(ids))])
            return [self.completion(i) for i in ids]
        finally:
            for i in ids:
                self.abort(i)
                self.release(i)

    def completion(self, request_id: str) -> Completion:
        """The `Completion` of a finished request (prefill time: from its arrival to its first token; with
        speculative decoding, the share of its drafts accepted).

        Raises:
            ValueError: an unknown request id, or a request that has not finished.
        """
        r = self.requests.get(request_id)
        if r is None:
            raise ValueError(f"unknown request id {request_id!r}")
        if r.status is not Status.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        added, first, last = self._times[request_id]
        rate = None if self.drafter is None else r.num_accepted / r.num_drafted if r.num_drafted else 0.0
        return Completion(list(r.output_ids), r.finish_reason or "length", len(r.prompt_ids), first - added, last - first,
                          acceptance_rate=rate, cached_tokens=r.num_cached_tokens)

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
