"""The prefix-cache file: an engine's named KV blocks and Mamba snapshots in one safetensors file.

Metadata (all strings): `format` "hybrid-prefix-cache", `version` "2", `identity` (the model's, which roots
every hash chain: a file of another model, dtype, quantization or weights is refused), `block_size`,
`blocks` (JSON: a list of {"parent": index of an earlier block or -1, "tokens": its block_size token ids},
parents first) and `snapshots` (JSON: a list of {"parent": block index or -1, "tail": fewer than
block_size token ids}). Names are not stored: they are recomputed from the tokens (`block_digest`), so
a file cannot name a block for a prefix it does not hold.

Tensors: `block.{i}.{j}.k` / `.v` [block_size, num_key_value_heads, head_dim] (attention layer j),
`snapshot.{i}.mamba.{j}.conv` [conv_dim, K-1] / `.ssm` [nh, P, N] (Mamba layer j), for a non-empty tail
`snapshot.{i}.kv.{j}.k` / `.v` [num_key_value_heads, len(tail), head_dim], and, when the snapshot kept it,
`snapshot.{i}.hidden` [hidden_size] (its last token's final hidden state: a prompt of exactly that prefix
then resumes from it whole); dtypes those of the pools.

Loading checks the whole file first; a file that fails adds nothing (`PrefixCacheFileError` names the file
and the entry). Saving writes beside the path and renames (`hybrid.atomic`).
"""

from __future__ import annotations

import json
import numbers
from collections import deque
from pathlib import Path

import torch

from hybrid.atomic import atomic_path
from hybrid.serving.blocks import BlockName, BlockPool
from hybrid.serving.prefix import PrefixCaching, Snapshot, block_digest
from hybrid.serving.slots import StateSlots

FORMAT, VERSION = "hybrid-prefix-cache", "2"


class PrefixCacheFileError(ValueError):
    """A prefix-cache file that cannot be used with this model (names the file and why)."""


def save(prefix: PrefixCaching, path: str | Path) -> None:
    """Write the named blocks reachable from the model identity and the snapshots whose blocks they are."""
    from safetensors.torch import save_file

    blocks = prefix.blocks
    children: dict[str, list[tuple[int, BlockName]]] = {}
    for block, name in sorted(blocks.named()):
        children.setdefault(name.parent, []).append((block, name))
    index: dict[str, int] = {prefix.identity: -1}
    entries, tensors = [], {}
    frontier = deque([prefix.identity])
    while frontier:  # parents first, breadth first from the identity: blocks not reachable from it are left out
        parent = frontier.popleft()
        for block, name in children.get(parent, ()):
            i = len(entries)
            index[name.digest] = i
            entries.append({"parent": index[parent], "tokens": list(name.tokens)})
            for j, (k, v) in enumerate(zip(blocks.k, blocks.v)):
                tensors[f"block.{i}.{j}.k"], tensors[f"block.{i}.{j}.v"] = k[block].contiguous(), v[block].contiguous()
            frontier.append(name.digest)
    snapshots = []
    for snapshot in prefix.snapshots.values():
        if snapshot.parent not in index:
            continue
        i = len(snapshots)
        snapshots.append({"parent": index[snapshot.parent], "tail": list(snapshot.tail)})
        for j, (conv, ssm) in enumerate(snapshot.mamba):
            tensors[f"snapshot.{i}.mamba.{j}.conv"], tensors[f"snapshot.{i}.mamba.{j}.ssm"] = conv.contiguous(), ssm.contiguous()
        if snapshot.tail:
            for j, (k, v) in enumerate(snapshot.tail_kv[:len(blocks.k)]):  # the main stack's (not the MTP block's)
                tensors[f"snapshot.{i}.kv.{j}.k"], tensors[f"snapshot.{i}.kv.{j}.v"] = k.contiguous(), v.contiguous()
        if snapshot.last_hidden is not None:
            tensors[f"snapshot.{i}.hidden"] = snapshot.last_hidden.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "identity": prefix.identity, "block_size": str(blocks.block_size),
            "blocks": json.dumps(entries), "snapshots": json.dumps(snapshots)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def load(prefix: PrefixCaching, slots: StateSlots, path: str | Path, vocab_size: int,
         hidden_size: int | None = None) -> int:
    """Add the blocks and snapshots of `path` (see `save`); returns the snapshots added. Blocks go into free
    blocks of the pool (grown first when it grows: `GrowingBlockPool`; otherwise as many as fit, parents first,
    least recently used cached blocks handed out first), each left free and named; a snapshot whose block did
    not fit is left out. Snapshots keep their last hidden states when `hidden_size` is given (checked against
    it), else drop them.

    Raises:
        PrefixCacheFileError: not a readable safetensors file (cut short, another format), another format
            or version, another model (identity) or block size, a malformed block or snapshot list (an entry
            that is not {"parent": int, "tokens"/"tail": [ids]}, a parent that is not an earlier block, a
            block of another length, a tail of block_size or more, an id outside [0, vocab_size)), or a
            missing tensor or one of another shape or dtype than the pools'.
    """
    from safetensors import SafetensorError, safe_open

    device = str(prefix.blocks.k[0].device) if prefix.blocks.k else "cpu"
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            blocks, snapshots = _read(prefix, slots, path, f, vocab_size, hidden_size)
    except (SafetensorError, OSError) as e:
        raise PrefixCacheFileError(f"{path}: not a readable prefix-cache file ({e})") from None
    pool = prefix.blocks
    new = [b for b in blocks if pool.find(b[0].digest) is None]
    pool.make_room(len(new))  # a growing pool takes them all; a server's, as many as fit
    loaded = []
    for name, kv in new[:pool.num_free]:
        block = pool.allocate()
        for k_pool, v_pool, (k, v) in zip(pool.k, pool.v, kv):
            k_pool[block], v_pool[block] = k, v
        pool.name(block, name)
        loaded.append(block)
    pool.release(loaded)  # last first, parents after their children: a prefix's head is handed out last
    usable = [s for s in snapshots if s.parent == prefix.identity or pool.find(s.parent) is not None]
    return sum(prefix.add(s) for s in usable)  # a snapshot whose blocks did not fit would never be used


def _read(prefix: PrefixCaching, slots: StateSlots, path, f, vocab_size: int, hidden_size: int | None):
    """([(BlockName, kv per attention layer)], [Snapshot]) of open file `f`, everything checked."""
    def bad(why: str) -> PrefixCacheFileError:
        return PrefixCacheFileError(f"{path}: {why}")

    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise bad(f"not a prefix-cache file of this project (format {str(meta.get('format', 'missing'))[:40]!r}, "
                  f"expected {FORMAT!r}; files of the earlier copy-based cache are not read: delete it to start anew)")
    if meta.get("version") != VERSION:
        raise bad(f"prefix-cache file version {str(meta.get('version'))[:20]!r}; this version reads {VERSION!r}")
    if meta.get("identity") != prefix.identity:
        raise bad(f"prefix cache was written for another model (identity {str(meta.get('identity', 'missing'))[:12]}, "
                  f"this model {prefix.identity[:12]})")
    bs = prefix.blocks.block_size
    if meta.get("block_size") != str(bs):
        raise bad(f"block_size {str(meta.get('block_size'))[:20]} differs from {bs}")
    block_entries = _entries(meta, "blocks", "tokens", bad)
    snapshot_entries = _entries(meta, "snapshots", "tail", bad)

    def ids(values, what: str, length_ok, expected: str) -> tuple[int, ...]:
        if not length_ok(len(values)):
            raise bad(f"{what} has {len(values)} token ids, expected {expected}")
        for t in values:
            if not (isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size):
                raise bad(f"{what} holds {str(t)[:20]}, not a token id in [0, {vocab_size})")
        return tuple(int(t) for t in values)

    keys = set(f.keys())

    def get(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in keys:
            raise bad(f"missing tensor {name}")
        t = f.get_tensor(name)
        if (tuple(t.shape), t.dtype) != (shape, dtype):
            raise bad(f"tensor {name} is {tuple(t.shape)} {t.dtype}, this model's are {shape} {dtype}")
        return t

    pool = prefix.blocks
    kv_shape = [(tuple(k.shape[1:]), k.dtype) for k in pool.k]
    digests, depth, blocks = [], [], []
    for i, e in enumerate(block_entries):
        if not -1 <= e["parent"] < i:
            raise bad(f"blocks entry {i}: parent {e['parent']} is not an earlier block (or -1)")
        tokens = ids(e["tokens"], f"blocks entry {i}", lambda n: n == bs, f"block_size = {bs}")
        parent = digests[e["parent"]] if e["parent"] >= 0 else prefix.identity
        digests.append(block_digest(parent, list(tokens)))
        depth.append(depth[e["parent"]] + 1 if e["parent"] >= 0 else 1)
        kv = [(get(f"block.{i}.{j}.k", s, d), get(f"block.{i}.{j}.v", s, d)) for j, (s, d) in enumerate(kv_shape)]
        blocks.append((BlockName(digests[-1], parent, tokens), kv))
    conv_spec = [(tuple(c.shape[1:]), c.dtype) for c in slots.conv]
    ssm_spec = [(tuple(s.shape[1:]), s.dtype) for s in slots.ssm]
    snapshots = []
    for i, e in enumerate(snapshot_entries):
        if not -1 <= e["parent"] < len(digests):
            raise bad(f"snapshots entry {i}: parent {e['parent']} is not a block of the file (or -1)")
        tail = ids(e["tail"], f"snapshots entry {i}", lambda n: n < bs, f"fewer than block_size = {bs}")
        mamba = [(get(f"snapshot.{i}.mamba.{j}.conv", *c), get(f"snapshot.{i}.mamba.{j}.ssm", *m))
                 for j, (c, m) in enumerate(zip(conv_spec, ssm_spec))]
        tail_kv = [(get(f"snapshot.{i}.kv.{j}.k", (s[1], len(tail), s[2]), d),
                    get(f"snapshot.{i}.kv.{j}.v", (s[1], len(tail), s[2]), d))
                   for j, (s, d) in enumerate(kv_shape)] if tail else []
        parent = digests[e["parent"]] if e["parent"] >= 0 else prefix.identity
        length = (depth[e["parent"]] if e["parent"] >= 0 else 0) * bs + len(tail)
        if length == 0:
            raise bad(f"snapshots entry {i} holds no tokens (parent -1 and an empty tail)")
        hidden = f"snapshot.{i}.hidden"
        last_hidden = get(hidden, (hidden_size,), kv_shape[0][1] if kv_shape else conv_spec[0][1]) \
            if hidden in keys and hidden_size is not None else None
        snapshots.append(Snapshot(parent, tail, length, mamba, tail_kv, last_hidden))
    return blocks, snapshots


def _entries(meta: dict, key: str, ids_key: str, bad) -> list[dict]:
    """The JSON list `meta[key]` of {"parent": int, ids_key: list}, shape-checked."""
    try:
        entries = json.loads(meta.get(key, ""))
    except (ValueError, RecursionError):  # not JSON, nested too deeply, an integer of more than 4300 digits
        raise bad(f"its {key} list (metadata {key!r}) is not JSON") from None
    form = f"{{'parent': int, '{ids_key}': [token ids]}}"
    if not isinstance(entries, list):
        raise bad(f"its {key} list is not a list of {form}")
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("parent"), int) and not isinstance(e.get("parent"), bool)
                and isinstance(e.get(ids_key), list)):
            raise bad(f"its {key} list is not a list of {form} (entry {i}: {str(e)[:80]})")
    return entries
