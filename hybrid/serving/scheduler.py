"""The scheduler of the serving engine: which sequences run in the next forward, with how many tokens.

Each step has a budget of `max_num_batched_tokens` tokens (vLLM's name), spent in this order:
1. the running requests, oldest first: a decoding request takes one token; a request still prefilling its
   prompt takes the next chunk (as much as the budget leaves; with prefix caching a chunk also ends at the
   next multiple of the snapshot interval, where its Mamba state is snapshotted). A chunk the budget would
   cut short of that end (or of the prompt's) by no more than the step's decode tokens runs to it: the step
   then holds up to `max_num_seqs - 1` tokens over the budget, and a long prompt takes one forward per chunk
   as without snapshots (vLLM's chunked prefill) instead of a chunk and a sliver. The trade: the long prompt's
   first token comes sooner, while the streams decoding beside it get one token per chunk instead of two per
   pair of steps (a longer inter-token latency meanwhile); the same work per second either way
   (docs/perf-log.md#chunk-to-snapshot);
2. then the waiting requests, first come first served, while a state slot is free, fewer than
   `max_num_seqs` run, the budget lasts and the free KV blocks hold their first chunk. A request resumes from
   its longest cached prefix (`hybrid.serving.prefix`) when admitted.

**Preemption** (vLLM's recompute policy): when a running request needs a KV block and none is free, the
youngest running request (the last admitted) is preempted: its blocks and slot are freed at once and it goes
back to the front of the waiting queue with its generated tokens kept; readmitted, it recomputes prompt and
output (its prefix-cache hit included) and goes on generating where it stopped, drawing from the same
sampling generator, so its tokens are the ones it would have produced uninterrupted. Reserving each
request's worst case up front was the alternative; it wastes the blocks of every request that stops early.
Admission never preempts. Every request fits the pool alone (`max_model_len` <= the pool's tokens), so the
oldest request always makes progress.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from hybrid.serving.blocks import BlockPool
from hybrid.serving.request import Request, Status
from hybrid.serving.slots import StateSlots

if TYPE_CHECKING:
    from hybrid.serving.prefix import PrefixCaching


class Scheduler:
    """Waiting and running requests over one `BlockPool` and one `StateSlots` pool (see the module docstring).

    A pool that grows (`GrowingBlockPool`: single-user generation) is enlarged instead of preempting or waiting
    when it runs out, and, while the prefix cache is within its byte budget, instead of handing out blocks that
    hold cached prefixes.
    Raises:
        ValueError: max_num_seqs or max_num_batched_tokens below 1.
    """

    def __init__(self, blocks: BlockPool, slots: StateSlots, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix: "PrefixCaching | None" = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs} and "
                             f"{max_num_batched_tokens}")
        self.blocks, self.slots, self.prefix = blocks, slots, prefix
        self.max_num_seqs = min(max_num_seqs, slots.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------------ one step
    def schedule(self) -> list[tuple[Request, int]]:
        """The (request, new tokens) pairs of the next forward, in packed order; their block tables already
        cover the new tokens."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        decodes = 0  # decode tokens scheduled so far: how far a prompt chunk may run past the budget
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, budget, decodes)
            if not self._grow(request, n):  # the request itself was preempted
                continue
            scheduled.append((request, n))
            budget -= n
            if n == 1 + len(request.draft_ids) and request.num_computed >= len(request.prompt_ids):
                decodes += 1
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.slots.num_free:
            request = self.waiting[0]
            if self.prefix is not None:
                self.prefix.resume(request)  # holds the shared blocks of its longest cached prefix
            n = self._chunk(request, budget, decodes)
            if not self._room(request, n):
                if self.prefix is not None:  # give back the hit's blocks until it can be admitted
                    self.prefix.forget(request)
                    self._release(request)
                break
            self.waiting.popleft()
            # a snapshot's states overwrite the whole slot: no zeroing first (11 MB a request on the medium preset)
            request.slot = self.slots.allocate(zero=self.prefix is None or not self.prefix.resuming(request))
            self._allocate(request, n)
            if self.prefix is not None:
                self.prefix.restore_state(request, self.slots)  # the hit's Mamba states and partial-block keys and values
            request.status = Status.RUNNING
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        return scheduled

    def _chunk(self, request: Request, budget: int, slack: int = 0) -> int:
        """Tokens `request` computes next: what is left of its tokens, within the budget and, while it
        prefills with prefix caching, up to the next snapshot boundary; past the budget by up to `slack`
        tokens when that reaches the end of this stretch (see the module docstring)."""
        stretch = request.num_tokens - request.num_computed + len(request.draft_ids)
        if self.prefix is not None and request.num_computed < len(request.prompt_ids):
            stretch = min(stretch, self.prefix.next_boundary(request) - request.num_computed)
        return stretch if stretch <= budget + slack else budget

    def _blocks_needed(self, request: Request, n: int) -> int:
        return max(0, math.ceil((request.num_computed + n) / self.blocks.block_size) - len(request.block_table))

    def _room(self, request: Request, n: int) -> bool:
        """Whether the free blocks hold `n` more tokens of `request` (growing the pool first if it grows)."""
        return self._free_blocks(self._blocks_needed(request, n))

    def _free_blocks(self, needed: int) -> bool:
        """Whether `needed` blocks are free (growing the pool first if it grows)."""
        if self.blocks.grows:  # cached prefixes' blocks are kept while the prefix cache is within its budget
            keep = self.blocks.num_free_cached() if self.prefix is not None and self.prefix.within_budget() else 0
            self.blocks.make_room(needed, keep)
        return needed <= self.blocks.num_free

    def own_block(self, request: Request, j: int) -> bool:
        """Replace block `j` of `request`'s table, which it shares, by a copy of its own (copy on write) if a free
        block holds it; never preempts. Whether it was replaced."""
        if not self._free_blocks(1):
            return False
        old, new = request.block_table[j], self.blocks.allocate()
        self.blocks.copy(old, new)
        self.blocks.release([old])
        request.block_table[j] = new
        return True

    def _allocate(self, request: Request, n: int) -> None:
        for _ in range(self._blocks_needed(request, n)):
            request.block_table.append(self.blocks.allocate())

    def _grow(self, request: Request, n: int) -> bool:
        """Give the running `request` the blocks for `n` more tokens, preempting the youngest running
        requests while too few are free. False when `request` itself had to be preempted."""
        while not self._room(request, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        self._allocate(request, n)
        return True

    # ------------------------------------------------------------------------------------------ freeing
    def preempt(self, request: Request) -> None:
        """Free `request`'s blocks and slot and queue it first, to be recomputed (see the module docstring)."""
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """End `request` (running or waiting) and free its blocks and slot at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def reserve_positions(self, request: Request, num_positions: int) -> bool:
        """Give the running `request` blocks for its first `num_positions` positions if free ones hold them (a
        growing pool grows); never preempts. Whether it holds them now (speculative drafting asks ahead)."""
        n = num_positions - request.num_computed
        if not self._room(request, n):
            return False
        self._allocate(request, n)
        return True

    def _release(self, request: Request) -> None:
        self.blocks.release(request.block_table)
        request.draft_ids, request.draft_probs = [], []
        request.block_table, request.num_computed = [], 0
        if request.slot is not None:
            self.slots.release(request.slot)
            request.slot = None
