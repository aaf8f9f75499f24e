"""Prefix caching of the whole hybrid inference state ("static content first").

A prompt that starts with tokens an earlier prompt already ran (a system prompt, tool definitions, a
document) resumes from the state the earlier prefill left after them instead of recomputing it. For a
hybrid model that state is every attention layer's keys and values *and* every Mamba layer's conv window
and SSM state; the Mamba part cannot be rebuilt from a KV cache, so it is snapshotted.

Layout (as vLLM's automatic prefix caching, with Mamba states as in its hybrid-model prefix caching):
- Prompts are cut into blocks of `block_size` tokens. Block i is named by a hash chain,
  `digest_i = sha256(digest_{i-1} || tokens of block i)`, with `digest_{-1}` the model's identity
  (`HybridForCausalLM.identity`: its config, dtype, quantization and weights), so one
  digest names the entire prefix up to the end of its block, and the longest cached prefix of a prompt is
  found by walking the chain.
- Each block is a node of a tree. A node holds the keys and values of its own block's tokens (every
  attention layer; the KV of a prefix is the concatenation along the path, so storage is linear in the
  prefix) and the Mamba states at the block's end (constant size per node).
- Memory is bounded: `max_bytes` over all nodes, least recently used leaves evicted first (a node's
  descendants need its keys and values, so inner nodes go only after their children).
- Reuse copies the snapshot into the request's cache; nothing is aliased, so a request's decoding never
  changes what a later request sees.

A hit must leave at least one prompt token to run (its logits give the first new token), so a prompt of
L tokens reuses at most floor((L - 1) / block_size) blocks. Prefixes shorter than a block are not cached.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid.atomic import atomic_path
from hybrid.cache import Cache
from hybrid.config import ATTENTION, MAMBA
from hybrid.model import HybridForCausalLM


class PrefixCacheFileError(ValueError):
    """A prefix-cache file that cannot be used with this model (names the file and why)."""


@dataclass
class _Node:
    """One cached block: its tokens' KV per attention layer and the Mamba states at its end."""

    digest: str
    parent: str | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: k, v [num_key_value_heads, block, head_dim]
    mamba: list[tuple[torch.Tensor, torch.Tensor]]  # per Mamba layer: conv [conv_dim, K-1], ssm [heads, head_dim, state]
    children: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = sum(t.nelement() * t.element_size() for pair in self.kv + self.mamba for t in pair)


class PrefixCache:
    """Snapshots of the inference state at block boundaries of earlier prompts, for one model.

    Args:
        model: the model whose states are cached (its identity keys the cache and saved files).
        block_size: tokens per block; smaller blocks find longer hits but store one Mamba snapshot
            (`HybridCache.state_nbytes()` of one sequence) per block.
        max_bytes: bound on the bytes of all snapshots (least recently used leaves evicted first).
    Raises:
        ValueError: block_size < 1 or max_bytes < 0.
    """

    def __init__(self, model: HybridForCausalLM, block_size: int = 256, max_bytes: int = 2**30):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.model = model
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.identity = model.identity
        self._nodes: OrderedDict[str, _Node] = OrderedDict()  # least recently used first
        self.hits = self.misses = 0
        self.reused_tokens = 0

    # ------------------------------------------------------------------------------------------ public
    @property
    def nbytes(self) -> int:
        """Bytes held by all snapshots."""
        return sum(node.nbytes for node in self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, prompt: list[int]) -> int:
        """Number of leading prompt tokens a prefill would reuse (a multiple of block_size, < len(prompt))."""
        return len(self._path(prompt)) * self.block_size

    @torch.inference_mode()
    def prefill(self, prompt: list[int], capacity: int = 0) -> tuple[Cache, torch.Tensor]:
        """Run `prompt` into a fresh batch-1 cache, reusing the longest cached prefix and caching every
        full block it computes.

        Returns (the cache, holding all of `prompt`; logits [1, V] float32 after its last token).
        Raises:
            ValueError: an empty prompt.
        """
        if not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        path = self._path(prompt)
        cache = self._restore(path, max(capacity, len(prompt)))
        if path:
            self.hits += 1
            self.reused_tokens += len(path) * self.block_size
        else:
            self.misses += 1
        parent = path[-1].digest if path else self.identity
        bs, pos = self.block_size, len(path) * self.block_size
        keep = {n.digest for n in path}  # the path in use is never evicted while it is extended
        logits = None
        while pos < len(prompt):
            end = min((pos // bs + 1) * bs, len(prompt))
            ids = torch.tensor([prompt[pos:end]], device=self.model.device)
            logits = self.model(ids, cache, logits_to_keep=1)[:, -1]
            if end % bs == 0:
                parent = self._insert(parent, prompt[end - bs : end], cache, end, keep)
                keep.add(parent)
            pos = end
        self._evict(keep=set())
        return cache, logits

    # ------------------------------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write every snapshot to one safetensors file, with the model identity and tree in its metadata.
        The file is written beside `path` and renamed into place (`hybrid.atomic`): an interrupted save
        leaves the previous file."""
        from safetensors.torch import save_file

        def depth(node: _Node) -> int:
            d = 0
            while node.parent is not None:
                node, d = self._nodes[node.parent], d + 1
            return d

        tensors, nodes = {}, []
        for i, node in enumerate(sorted(self._nodes.values(), key=depth)):  # parents before children
            nodes.append({"digest": node.digest, "parent": node.parent})
            for j, (k, v) in enumerate(node.kv):
                tensors[f"{i}.kv.{j}.k"], tensors[f"{i}.kv.{j}.v"] = k.contiguous(), v.contiguous()
            for j, (conv, ssm) in enumerate(node.mamba):
                tensors[f"{i}.mamba.{j}.conv"], tensors[f"{i}.mamba.{j}.ssm"] = conv.contiguous(), ssm.contiguous()
        meta = {"identity": self.identity, "block_size": str(self.block_size), "nodes": json.dumps(nodes)}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    def load(self, path: str | Path) -> int:
        """Add the snapshots saved in `path` (see `save`); returns how many were added. The whole file is
        checked before anything is added: a file that fails adds nothing.

        Raises:
            PrefixCacheFileError: the file is not a readable safetensors file (cut short, another format),
                was written for another model (identity) or another block size, or its node list (an entry
                without "digest" or "parent", a duplicated digest, a node that is its own parent, a parent
                that is not an earlier entry, hence any cycle) or a tensor (missing, or of another shape or
                dtype than this model's snapshots) is malformed. The message names the file and the entry.
        """
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device=str(self.model.device)) as f:
                nodes = self._read_nodes(path, f)
        except (SafetensorError, OSError) as e:
            raise PrefixCacheFileError(f"{path}: not a readable prefix-cache file ({e})") from None
        added = 0
        for node in nodes:
            if node.digest not in self._nodes and (node.parent is None or node.parent in self._nodes):
                self._add(node)
                added += 1
        self._evict(keep=set())
        return added

    def _read_nodes(self, path, f) -> list[_Node]:
        """The nodes of open safetensors file `f`, every name, shape and dtype checked (see `load`)."""
        def bad(why: str) -> PrefixCacheFileError:
            return PrefixCacheFileError(f"{path}: {why}")

        meta = f.metadata() or {}
        if meta.get("identity") != self.identity:
            raise bad(f"prefix cache was written for another model (identity {str(meta.get('identity', 'missing'))[:12]}, "
                      f"this model {self.identity[:12]})")
        if meta.get("block_size") != str(self.block_size):
            raise bad(f"block_size {meta.get('block_size')} differs from {self.block_size}")
        try:
            entries = json.loads(meta.get("nodes", ""))
        except (ValueError, RecursionError):  # not JSON, nested too deeply, an integer of more than 4300 digits
            raise bad("its node list (metadata 'nodes') is not JSON") from None
        if not isinstance(entries, list):
            raise bad("its node list is not a list of {'digest': str, 'parent': str or null}")
        seen: set[str] = set()
        for i, e in enumerate(entries):  # a tree written parents first (`save`): no duplicate, no cycle
            if not (isinstance(e, dict) and isinstance(e.get("digest"), str) and "parent" in e
                    and (e["parent"] is None or isinstance(e["parent"], str))):
                raise bad(f"its node list is not a list of {{'digest': str, 'parent': str or null}} "
                          f"(entry {i}: {str(e)[:80]})")
            if e["digest"] in seen:
                raise bad(f"its node list has digest {e['digest'][:12]} twice (entry {i})")
            if e["parent"] == e["digest"]:
                raise bad(f"its node list has a node that is its own parent (entry {i}, {e['digest'][:12]})")
            if e["parent"] is not None and e["parent"] not in seen:
                raise bad(f"its node list has a parent that is not an earlier entry (entry {i}, parent "
                          f"{e['parent'][:12]}): not a tree written parents first")
            seen.add(e["digest"])
        kv_spec, mamba_spec = self._snapshot_specs()
        keys, nodes = set(f.keys()), []
        for i, entry in enumerate(entries):
            def get(name: str, spec: tuple[tuple[int, ...], torch.dtype]) -> torch.Tensor:
                if f"{i}.{name}" not in keys:
                    raise bad(f"missing tensor {i}.{name}")
                t = f.get_tensor(f"{i}.{name}")
                if (tuple(t.shape), t.dtype) != spec:
                    raise bad(f"tensor {i}.{name} is {tuple(t.shape)} {t.dtype}, this model's snapshots are "
                              f"{spec[0]} {spec[1]}")
                return t

            kv = [(get(f"kv.{j}.k", s), get(f"kv.{j}.v", s)) for j, s in enumerate(kv_spec)]
            mamba = [(get(f"mamba.{j}.conv", c), get(f"mamba.{j}.ssm", m)) for j, (c, m) in enumerate(mamba_spec)]
            nodes.append(_Node(entry["digest"], entry["parent"], kv, mamba))
        return nodes

    def _snapshot_specs(self):
        """(shape, dtype) of one block's keys (or values) per attention layer, and of (conv, ssm) per Mamba layer."""
        cache = self.model.new_cache(1, self.block_size)
        kv = [((k.shape[0], self.block_size, k.shape[2]), k.dtype) for k, _ in cache.snapshot_kv(0, 0, 0)]
        mamba = [((tuple(c.shape), c.dtype), (tuple(m.shape), m.dtype)) for c, m in cache.snapshot_mamba(0)]
        return kv, mamba

    # ------------------------------------------------------------------------------------------ internals
    def _digest(self, parent: str, block: list[int]) -> str:
        return hashlib.sha256(parent.encode() + torch.tensor(block, dtype=torch.int64).numpy().tobytes()).hexdigest()

    def _path(self, prompt: list[int]) -> list[_Node]:
        """Cached nodes along `prompt`'s chain, stopping before the block holding its last token."""
        path, digest = [], self.identity
        for start in range(0, len(prompt) - 1 - self.block_size + 1, self.block_size):
            digest = self._digest(digest, prompt[start : start + self.block_size])
            node = self._nodes.get(digest)
            if node is None:
                break
            path.append(node)
        for node in path:
            self._nodes.move_to_end(node.digest)
        return path

    def _restore(self, path: list[_Node], capacity: int) -> Cache:
        """A batch-1 cache holding the snapshot at the end of `path` (copied, never aliased)."""
        cache = self.model.new_cache(1, capacity)
        if path:
            kv = [(torch.cat([node.kv[j][0] for node in path], dim=1), torch.cat([node.kv[j][1] for node in path], dim=1))
                  for j in range(len(path[0].kv))]
            cache.restore(0, len(path) * self.block_size, kv, path[-1].mamba)
        return cache

    def _insert(self, parent: str, block: list[int], cache: Cache, end: int, keep: set[str]) -> str:
        """Snapshot `cache` (batch 1, `end` positions, ending with `block`) as the child of `parent`."""
        digest = self._digest(parent, block)
        if digest in self._nodes:
            self._nodes.move_to_end(digest)
            return digest
        kv, mamba = cache.snapshot_kv(0, end - self.block_size, end), cache.snapshot_mamba(0)
        self._add(_Node(digest, None if parent == self.identity else parent, kv, mamba))
        self._evict(keep | {digest})
        return digest

    def _add(self, node: _Node) -> None:
        if node.parent is not None:
            self._nodes[node.parent].children += 1
        self._nodes[node.digest] = node

    def _evict(self, keep: set[str]) -> None:
        """Drop least recently used leaves until the bound holds (never one in `keep`)."""
        total = self.nbytes
        while total > self.max_bytes:
            victim = next((n for n in self._nodes.values() if n.children == 0 and n.digest not in keep), None)
            if victim is None:
                return
            del self._nodes[victim.digest]
            if victim.parent is not None and victim.parent in self._nodes:
                self._nodes[victim.parent].children -= 1
            total -= victim.nbytes
