"""The KV block pool of a server: every attention layer's keys and values in fixed-size blocks (PagedAttention).

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"; the
layout and the free-block queue follow vLLM's `BlockPool` / `KVCacheManager`.

- One pool is allocated at start: per attention layer `k`, `v` [num_blocks, block_size, num_key_value_heads,
  head_dim] in the model dtype, so resident memory stays flat however requests come and go
  (`GrowingBlockPool` is for single-user generation, whose pool follows its longest call).
- A sequence holds a block table (block ids, in position order): position p lives in block
  `table[p // block_size]` at offset `p % block_size`. Its blocks need not be contiguous or in order.
- Blocks are reference-counted: a block full of a shared prefix is held once by every sequence using it.
- A block whose count falls to 0 returns to the free queue but keeps its contents and, when it was full and
  named by a prefix hash (`hybrid.serving.prefix`), stays findable by that hash until it is handed out again:
  the queue hands out the least recently freed block first (vLLM's eviction order), and a sequence frees its
  blocks last block first, so the tails of prefixes are evicted before their heads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from hybrid.config import ATTENTION, HybridConfig


class NoFreeBlocks(RuntimeError):
    """The pool has no free block (the scheduler preempts or waits)."""


@dataclass(frozen=True)
class BlockName:
    """What a full block holds: the prefix named `digest`, whose previous block is named `parent` (the
    model identity for the first block), ending with `tokens`."""

    digest: str
    parent: str
    tokens: tuple[int, ...]


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens for every attention layer of `config`.

    Attributes:
        k, v: per attention layer (in pattern order), [num_blocks, block_size, num_key_value_heads, head_dim].
        mtp_k, mtp_v: the same for the attention layers of the MTP block (`config.mtp_pattern`) when `mtp`
            (speculative decoding drafts with it), else empty. Prefix snapshots and files hold `k`, `v` only.
        refcount: [num_blocks] Python ints, the sequences holding each block.
    Raises:
        ValueError: num_blocks or block_size below 1.
    """

    def __init__(self, config: HybridConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", mtp: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)

        def pools(pattern: str) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(pattern.count(ATTENTION))]

        self.k, self.v = pools(config.hybrid_override_pattern), pools(config.hybrid_override_pattern)
        self.mtp_k, self.mtp_v = (pools(config.mtp_pattern), pools(config.mtp_pattern)) if mtp else ([], [])
        self.refcount = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._name_of: dict[int, BlockName] = {}  # block -> the prefix its contents hold
        self._block_of: dict[str, int] = {}  # prefix hash -> block
        self.evicted: list[str] = []  # names forgotten since the prefix cache last looked (`take_evicted`)

    # ------------------------------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks with no holder (cached contents included: they are handed out when needed)."""
        return len(self._free)

    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated at start)."""
        return sum(t.nelement() * t.element_size() for t in self.k + self.v + self.mtp_k + self.mtp_v)

    # ------------------------------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """A block for new contents, held once; the least recently freed one (forgetting its hash).

        Raises:
            NoFreeBlocks: every block is held.
        """
        if not self._free:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        name = self._name_of.pop(block, None)
        if name is not None:
            del self._block_of[name.digest]
            self.evicted.append(name.digest)
        self.refcount[block] = 1
        return block

    grows = False  # a server's pool is sized once (`GrowingBlockPool` follows its use)

    def make_room(self, needed: int, keep: int = 0) -> None:
        """Let `needed` more blocks be handed out while `keep` free ones stay unused: nothing to do for a pool
        sized once (its caller then preempts or waits); `GrowingBlockPool` grows."""

    def hold(self, block: int) -> None:
        """One more holder of `block` (a sequence sharing it); a free cached block leaves the free queue."""
        if self.refcount[block] == 0:
            del self._free[block]
        self.refcount[block] += 1

    def shared(self, block: int) -> bool:
        """Whether writing into `block` could change what another sequence or the prefix cache reads: it is held
        more than once or named by a prefix hash."""
        return self.refcount[block] > 1 or block in self._name_of

    def copy(self, src: int, dst: int) -> None:
        """Copy block `src`'s keys and values (every layer, the MTP block's too) into block `dst`."""
        for pool in self.k + self.v + self.mtp_k + self.mtp_v:
            pool[dst].copy_(pool[src])

    def release(self, blocks: list[int]) -> None:
        """Drop one holder of each block, last block first; blocks left with none become free (their
        contents and hash kept until handed out)."""
        for block in reversed(blocks):
            if self.refcount[block] < 1:
                raise ValueError(f"KV block {block} is not held")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free[block] = None

    # ------------------------------------------------------------------------------------------ prefix hashes
    def name(self, block: int, name: BlockName) -> None:
        """Record that the full block `block` holds the prefix `name` (the first block to hold a prefix
        keeps the name)."""
        if name.digest not in self._block_of and block not in self._name_of:
            self._block_of[name.digest] = block
            self._name_of[block] = name

    def find(self, digest: str) -> int | None:
        """The block holding the prefix named `digest`, or None."""
        return self._block_of.get(digest)

    def named(self) -> list[tuple[int, BlockName]]:
        """Every named block with its name."""
        return list(self._name_of.items())

    def num_cached(self) -> int:
        """Blocks named by a prefix hash (held or free)."""
        return len(self._block_of)

    def num_free_cached(self) -> int:
        """Free blocks that still hold a named prefix (handed out last)."""
        return sum(1 for b in self._name_of if self.refcount[b] == 0)

    def block_nbytes(self) -> int:
        """Bytes of one block (every attention layer's keys and values)."""
        return self.nbytes() // self.num_blocks

    def take_evicted(self) -> list[str]:
        """The names forgotten (their blocks handed out again) since the last call."""
        evicted, self.evicted = self.evicted, []
        return evicted


class GrowingBlockPool(BlockPool):
    """A `BlockPool` that grows (at least doubling) when it runs out instead of making its users wait: for one
    user's generation calls (`hybrid.generate_ids`, `hybrid.prefix_cache.PrefixCache`), never for a server."""

    grows = True

    def make_room(self, needed: int, keep: int = 0) -> None:
        """Grow until `needed` blocks are free beside `keep` (at least doubling, so a long generation grows
        O(log n) times)."""
        short = needed - (self.num_free - keep)
        if short > 0:
            self.grow(max(2 * self.num_blocks, self.num_blocks + short))

    def grow(self, num_blocks: int) -> None:
        """Enlarge the pool to `num_blocks` blocks (ids and contents kept; the new blocks are handed out
        before any cached one)."""
        if num_blocks <= self.num_blocks:
            return
        for pools in (self.k, self.v, self.mtp_k, self.mtp_v):
            for j, t in enumerate(pools):
                new = t.new_zeros(num_blocks, *t.shape[1:])
                new[: self.num_blocks] = t
                pools[j] = new
        for b in range(num_blocks - 1, self.num_blocks - 1, -1):
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        self.refcount += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = num_blocks
