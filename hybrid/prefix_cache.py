"""Prefix caching for one user's generation calls ("static content first"), on the serving engine.

A prompt that starts with tokens an earlier prompt already ran (a system prompt, tool definitions, a
document, the earlier turns of a conversation) resumes from the state left after them instead of
recomputing it. `PrefixCache` keeps one `hybrid.serving.engine.Engine` with prefix caching across calls of
`hybrid.generate` / `generate_ids` (`prefix_cache=`) and `hybrid generate --prefix-cache FILE`: its KV pool
holds every attention layer's keys and values in shared, hash-named blocks; its snapshots hold the Mamba
states every `snapshot_interval` prompt tokens and at each prompt's end (the design: `hybrid.serving.prefix`).
Nothing is copied when a prefix is reused but its Mamba states (and the keys and values of its last
partial block), and a request never writes into a shared block, so decoding never changes what a later
request sees. Unlike a server's pool, this one grows with the calls (the longest call's tokens).

    cache = PrefixCache(model)
    hybrid.generate(model, tokenizer, [doc + q1], prefix_cache=cache)
    hybrid.generate(model, tokenizer, [doc + q2], prefix_cache=cache)   # resumes after doc
    cache.save("doc.safetensors"); cache.load("doc.safetensors")         # keyed by the model identity
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Callable

from hybrid.model import HybridForCausalLM
from hybrid.sampling import Completion, Sampling
from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE
from hybrid.serving.engine import Engine
from hybrid.serving.prefix_file import PrefixCacheFileError

__all__ = ["PrefixCache", "PrefixCacheFileError", "DEFAULT_SNAPSHOT_INTERVAL"]

DEFAULT_SNAPSHOT_INTERVAL = 256
_INITIAL_BLOCKS = 64


class PrefixCache:
    """Prefix caching across generation calls of one model (see the module docstring).

    Args:
        model: the model whose states are cached (its identity keys the hash chains and saved files).
        snapshot_interval: prompt tokens between Mamba snapshots (a multiple of `block_size`): hits fall on
            these positions and on earlier prompts' ends; each snapshot weighs one sequence's Mamba state.
        max_bytes: bound on the bytes of all snapshots, least recently used evicted first (the KV of cached
            prefixes lives in the engine's pool, in free blocks handed out again when a call needs them).
        block_size: tokens per KV block.
        num_speculative_tokens: the calls draft this many tokens per step with the MTP block and verify them
            (`hybrid.serving.speculation`; 0: off).
    Raises:
        ValueError: snapshot_interval not a positive multiple of block_size, block_size below 1,
            max_bytes below 0, or num_speculative_tokens below 0 or with a model without an MTP block.
    """

    def __init__(self, model: HybridForCausalLM, snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
                 max_bytes: int = 2**30, block_size: int = DEFAULT_BLOCK_SIZE, num_speculative_tokens: int = 0):
        if not (isinstance(max_bytes, numbers.Integral) and not isinstance(max_bytes, bool) and max_bytes >= 0):
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r:.80}")
        self.model = model
        self.engine = Engine(model, num_blocks=_INITIAL_BLOCKS, block_size=block_size, max_num_seqs=1,
                             prefix_caching=True, snapshot_interval=snapshot_interval, prefix_cache_bytes=max_bytes,
                             grow=True, num_speculative_tokens=num_speculative_tokens)
        self._prefix = self.engine.prefix
        self.num_speculative_tokens = num_speculative_tokens

    @property
    def identity(self) -> str:
        return self._prefix.identity

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens taken from the cache over every call."""
        return self._prefix.cached_tokens

    @property
    def hits(self) -> int:
        return self._prefix.hits

    @property
    def misses(self) -> int:
        return self._prefix.queries - self._prefix.hits

    @property
    def nbytes(self) -> int:
        """Bytes of the snapshots and of the cached KV blocks."""
        blocks = self.engine.blocks
        return self._prefix.nbytes + blocks.num_cached() * blocks.block_nbytes()

    def __len__(self) -> int:
        """Snapshots kept."""
        return len(self._prefix.snapshots)

    def match(self, prompt: list[int]) -> int:
        """Prompt tokens a call with `prompt` would take from the cache now (fewer than len(prompt))."""
        return self._prefix.match(prompt)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
                 stop_ids=(), on_tokens: Callable[[list[int | None]], None] | None = None) -> list[Completion]:
        """Generate for token-id `prompts` together on the engine (see `Engine.generate`), each resuming
        from its longest cached prefix and leaving its own prefix cached."""
        self.engine.reserve(len(prompts))
        return self.engine.generate(prompts, sampling, max_new_tokens, stop_ids, on_tokens)

    def save(self, path: str | Path) -> None:
        """Write the cached blocks and snapshots to one safetensors file (`hybrid.serving.prefix_file`),
        beside `path` and renamed into place: an interrupted save leaves the previous file."""
        self.engine.save_prefix_cache(path)

    def load(self, path: str | Path) -> int:
        """Add the blocks and snapshots saved in `path`; returns the snapshots added. The whole file is checked
        first: a file that fails adds nothing.

        Raises:
            PrefixCacheFileError: see `hybrid.serving.prefix_file.load` (the message names the file).
        """
        return self.engine.load_prefix_cache(path)
