"""Prefix caching across requests for a hybrid model: hash-chained KV blocks and Mamba state snapshots.

vLLM's automatic prefix caching names each full KV block by a hash chain over the tokens up to its end;
for a hybrid model that is not enough, since the Mamba state at a position cannot be rebuilt from keys and
values: it must have been kept. So the engine keeps two things:

- **Named KV blocks** (in the `BlockPool`): once a block of a request is full, it is named
  `digest_i = sha256(digest_{i-1} || tokens of block i)` with `digest_{-1}` the model's identity
  (`HybridForCausalLM.identity`), so a name stands for the whole prefix up to the block's end in this model.
  Named blocks stay in the pool after their requests finish, until the pool hands them out again (least
  recently freed first).
- **Snapshots**: the Mamba states of a request's slot at prompt positions that are multiples of
  `snapshot_interval` (prefill chunks end there) and at the end of its prompt, each with the keys and values
  of its last partial block (fewer than `block_size` tokens) and the final hidden state of its last token
  (what the logits of the next token are computed from), keyed by the name of its last full block and the
  partial block's tokens. They count against `max_bytes`, least recently used evicted first.

A new request resumes from the longest snapshot that matches its prompt (the whole prompt included: a prompt
sent again computes nothing, its first token's logits come from the kept hidden state, where vLLM recomputes
the last token) and whose full blocks are all still named in the pool: it holds
those blocks (shared, reference-counted), the snapshot's partial-block keys and values are copied into a
block of its own and the Mamba states into its slot. Shared blocks are never written: a request writes only
positions past its resume point, which lie in its own blocks. Turn 2 of a conversation resumes at turn 1's
prompt end (even when the template re-renders the reply differently), a repeated system prompt at the last
snapshot inside it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from hybrid.serving.blocks import BlockName, BlockPool
from hybrid.serving.paged_cache import PagedCache
from hybrid.serving.request import Request
from hybrid.serving.slots import StateSlots

DEFAULT_SNAPSHOT_INTERVAL = 512  # prompt tokens between Mamba snapshots (a multiple of the block size)
DEFAULT_MAX_BYTES = 2**30
MAX_SPARE = 2  # dropped snapshots' Mamba states kept for reuse (outside max_bytes)


def block_digest(parent: str, tokens: list[int]) -> str:
    """The name of a block of `tokens` following the prefix named `parent` (sha256 over the parent's name and
    the tokens as little-endian int64; packed by `struct`, cheaper than a tensor's bytes, and a 2K-token prompt
    has 128 blocks: docs/perf-log.md#block-digest-struct)."""
    return hashlib.sha256(parent.encode() + struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()


@dataclass
class Snapshot:
    """The state of a prefix of `length` tokens beyond its named full blocks.

    parent: the name of the last full block (the model identity when there is none); tail: the tokens of the
    partial block after it; mamba: per Mamba layer (conv [conv_dim, K-1], ssm [nh, P, N]); tail_kv: per
    attention layer (k, v) [nkv, len(tail), hd]; last_hidden: the normalised final hidden state of the
    prefix's last token [hidden_size] (`HybridForCausalLM.hidden_states`), or None (then a prompt of exactly
    this prefix cannot resume from it: its first token needs these logits).
    """

    parent: str
    tail: tuple[int, ...]
    length: int
    mamba: list[tuple[torch.Tensor, torch.Tensor]]
    tail_kv: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor | None = None
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = sum(t.nelement() * t.element_size() for pair in self.mamba + self.tail_kv for t in pair)
        if self.last_hidden is not None:
            self.nbytes += self.last_hidden.nelement() * self.last_hidden.element_size()


class PrefixCaching:
    """The prefix cache of one engine (see the module docstring).

    Args:
        identity: the model's identity (`HybridForCausalLM.identity`): the root of every hash chain.
        snapshot_interval: prompt tokens between snapshots, a multiple of the block size.
        max_bytes: bound on the bytes of all snapshots (the named blocks live in the KV pool itself).
    Raises:
        ValueError: snapshot_interval not a positive multiple of the block size, or max_bytes below 0.
    Attributes:
        hits, queries: admissions that resumed from a snapshot, and admissions;
        cached_tokens: prompt tokens taken from the cache in all.
    """

    def __init__(self, identity: str, blocks: BlockPool, snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL, max_bytes: int = DEFAULT_MAX_BYTES):
        bs = blocks.block_size
        if snapshot_interval < 1 or snapshot_interval % bs:
            raise ValueError(f"snapshot_interval must be a positive multiple of the block size {bs}, got "
                             f"{snapshot_interval}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.identity, self.blocks = identity, blocks
        self.snapshot_interval, self.max_bytes = snapshot_interval, max_bytes
        self.snapshots: OrderedDict[tuple[str, tuple[int, ...]], Snapshot] = OrderedDict()  # LRU first
        self._tails: dict[str, set[tuple[int, ...]]] = {}  # parent -> tails snapshotted after it
        self.nbytes = 0
        self.hits = self.queries = self.cached_tokens = 0
        self._pending: dict[str, Snapshot] = {}  # request id -> the snapshot it resumes from
        # the Mamba states of dropped snapshots, written again by the next ones: an 11 MB snapshot of the medium
        # preset (47 MB for Nano) cloned into fresh pages costs their page faults
        # (docs/perf-log.md#snapshot-spare-states)
        self._spare: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    # ------------------------------------------------------------------------------------------ names
    def digests(self, request: Request, num_blocks: int) -> list[str]:
        """The names of `request`'s first `num_blocks` full blocks (kept on the request as they are made)."""
        bs, ids = self.blocks.block_size, None
        while len(request.block_hashes) < num_blocks:
            ids = request.all_ids if ids is None else ids
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else self.identity
            request.block_hashes.append(block_digest(parent, ids[i * bs:(i + 1) * bs]))
        return request.block_hashes[:num_blocks]

    # ------------------------------------------------------------------------------------------ admission
    def within_budget(self) -> bool:
        """Whether the snapshots and the cached blocks together fit `max_bytes` (a pool that grows keeps
        its cached blocks while they do)."""
        self._prune()
        return self.nbytes + self.blocks.num_cached() * self.blocks.block_nbytes() <= self.max_bytes

    def _prune(self) -> None:
        """Drop the snapshots that follow a block the pool handed out again (they can never be used)."""
        for digest in self.blocks.take_evicted():
            for tail in self._tails.pop(digest, ()):
                self._drop(self.snapshots.pop((digest, tail)))

    def lookup(self, prompt: list[int], names: list[str]) -> tuple[list[int], Snapshot] | None:
        """The blocks and snapshot `prompt` would resume from (its longest usable snapshot: shorter than the
        prompt, or all of it when the snapshot kept its last hidden state), or None. `names`: the names of
        its full blocks."""
        self._prune()
        bs = self.blocks.block_size
        present = 0
        while present < len(names) and self.blocks.find(names[present]) is not None:
            present += 1
        for k in range(present, -1, -1):
            parent = names[k - 1] if k else self.identity
            best = None
            for tail in self._tails.get(parent, ()):
                end = k * bs + len(tail)
                whole = end == len(prompt) and self.snapshots[(parent, tail)].last_hidden is not None
                if (end < len(prompt) or whole) and tuple(prompt[k * bs:end]) == tail and (best is None or len(tail) > len(best)):
                    best = tail
            if best is not None:
                return [self.blocks.find(n) for n in names[:k]], self.snapshots[(parent, best)]
        return None

    def match(self, prompt: list[int]) -> int:
        """Prompt tokens a request of `prompt` would take from the cache now (nothing is held)."""
        names, parent = [], self.identity
        for i in range(len(prompt) // self.blocks.block_size):
            parent = block_digest(parent, prompt[i * self.blocks.block_size:(i + 1) * self.blocks.block_size])
            names.append(parent)
        hit = self.lookup(prompt, names)
        return 0 if hit is None else hit[1].length

    def resume(self, request: Request) -> None:
        """Find `request`'s longest usable snapshot; hold its full blocks (as the request's first blocks) and
        set `num_computed` to its length. The states are written by `restore_state` once the request has a
        slot and its next blocks. The scheduler undoes this (`forget`, releasing the blocks) if it cannot
        admit the request. `restore_state` hands the kept hidden state of the snapshot's last token to the
        request (`Request.resume_hidden`): a hit on the whole prompt leaves nothing to compute, its first token
        comes from it."""
        request.num_cached_tokens = 0
        prompt = request.prompt_ids
        hit = self.lookup(prompt, self.digests(request, len(prompt) // self.blocks.block_size))
        if hit is None:
            return
        table, snapshot = hit
        self.snapshots.move_to_end((snapshot.parent, snapshot.tail))
        for block in table:
            self.blocks.hold(block)
        request.block_table = table
        request.num_computed = request.num_cached_tokens = snapshot.length
        self._pending[request.request_id] = snapshot

    def restore_state(self, request: Request, slots: StateSlots) -> None:
        """Copy the pending snapshot's Mamba states into the request's slot of `slots` and its partial
        block's keys and values into the request's own block after the shared ones."""
        snapshot = self._pending.pop(request.request_id, None)
        self.queries += 1
        if snapshot is None:
            return
        self.hits += 1
        self.cached_tokens += snapshot.length
        # the whole prompt (and no output yet): nothing to run, the first token comes from the kept hidden
        # state; a drafting engine also reruns the MTP block's last cached position with it
        request.resume_hidden = snapshot.last_hidden
        slots.write(request.slot, snapshot.mamba)
        if snapshot.tail:  # the MTP block's keys too, when the snapshot holds them (not when loaded from a file)
            block = request.block_table[snapshot.length // self.blocks.block_size]
            for k_pool, v_pool, (k, v) in zip(self.blocks.k + self.blocks.mtp_k, self.blocks.v + self.blocks.mtp_v,
                                              snapshot.tail_kv):
                k_pool[block, :len(snapshot.tail)] = k.transpose(0, 1)
                v_pool[block, :len(snapshot.tail)] = v.transpose(0, 1)

    def resuming(self, request: Request) -> bool:
        """Whether `restore_state` will write all of `request`'s Mamba states (a snapshot is pending for it)."""
        return request.request_id in self._pending

    def forget(self, request: Request) -> None:
        """Drop a pending resume (the scheduler could not admit the request after all)."""
        self._pending.pop(request.request_id, None)

    def next_boundary(self, request: Request) -> int:
        """Where the prefill chunk of `request` must end at the latest: the next snapshot position."""
        step = self.snapshot_interval
        return min(len(request.prompt_ids), (request.num_computed // step + 1) * step)

    # ------------------------------------------------------------------------------------------ after a forward
    def after_step(self, scheduled: list[tuple[Request, int]], cache: PagedCache, last_hidden: torch.Tensor) -> None:
        """Name the blocks that this forward filled and snapshot the states at snapshot positions; row `i`
        of `cache` is `scheduled[i]` (whose `num_computed` already counts this forward) and `last_hidden[i]`
        the final hidden state of its last token this forward."""
        bs = self.blocks.block_size
        for row, (request, n) in enumerate(scheduled):
            full = request.num_computed // bs
            first = (request.num_computed - n) // bs
            names = self.digests(request, full)
            ids = request.all_ids if full > first else None
            for b in range(first, full):
                parent = names[b - 1] if b else self.identity
                self.blocks.name(request.block_table[b], BlockName(names[b], parent, tuple(ids[b * bs:(b + 1) * bs])))
            length, prompt = request.num_computed, len(request.prompt_ids)
            if length <= prompt and (length % self.snapshot_interval == 0 or length == prompt):
                self._snapshot(request, row, cache, last_hidden[row])

    def _snapshot(self, request: Request, row: int, cache: PagedCache, last_hidden: torch.Tensor) -> None:
        self._prune()
        bs, length = self.blocks.block_size, request.num_computed
        k = length // bs
        parent = self.digests(request, k)[-1] if k else self.identity
        key = (parent, tuple(request.prompt_ids[k * bs:length]))
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        mamba = cache.snapshot_mamba(row, out=self._spare.pop() if self._spare else None)
        self.add(Snapshot(parent, key[1], length, mamba, cache.snapshot_kv(row, k * bs, length), last_hidden.clone()))

    def add(self, snapshot: Snapshot) -> bool:
        """Keep `snapshot` (most recently used), evicting the least recently used ones past `max_bytes`;
        False when it is already kept or alone exceeds the bound."""
        key = (snapshot.parent, snapshot.tail)
        if key in self.snapshots or snapshot.nbytes > self.max_bytes:
            return False
        self.snapshots[key] = snapshot
        self._tails.setdefault(snapshot.parent, set()).add(snapshot.tail)
        self.nbytes += snapshot.nbytes
        while self.nbytes > self.max_bytes:
            (old_parent, old_tail), old = self.snapshots.popitem(last=False)
            self._tails[old_parent].discard(old_tail)
            if not self._tails[old_parent]:
                del self._tails[old_parent]
            self._drop(old)
        return True

    def _drop(self, snapshot: Snapshot) -> None:
        """Forget a snapshot no longer kept; keep its Mamba states (a few at most) for the next snapshots."""
        self.nbytes -= snapshot.nbytes
        if len(self._spare) < MAX_SPARE:
            self._spare.append(snapshot.mamba)
