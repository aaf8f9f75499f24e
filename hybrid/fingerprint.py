"""Model identity: a digest naming a model's weights and everything else that changes its numbers.

Caches keyed by it (the prefix cache's files) are never used for a model they were not made from.

    identity = sha256(config.json's content, dtype, quantization config, act_quant, weights digest)
    weights digest = sha256 over the tensors sorted by name of (name, shape, dtype, xxh3-128 of every byte)

Every byte of every weight is read, so a change of one element anywhere (one value in the middle of one
expert of one bank) gives another identity, as do another dtype, quantization or activation option. The
digest is taken on first use (`HybridForCausalLM.identity`), not at load: hashing reads all the weights once
(a time that grows with the checkpoint's bytes: docs/perf-log.md#identity-digest-rate), a cost only a user of
a cache keyed by it pays. xxh3 is not a cryptographic hash: the identity guards against using a cache with the
wrong model by mistake, not against a crafted collision.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch
import xxhash


class WeightsDigest:
    """The weights digest, built one tensor at a time; a tensor may come in pieces (an expert bank one expert
    at a time): the pieces' bytes, in order, are hashed as the whole tensor's."""

    def __init__(self):
        self.parts: dict[str, str] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: Iterable[torch.Tensor]) -> None:
        """Tensor `name` of `shape` and `dtype`, given as `pieces` whose bytes joined in order are its
        row-major bytes (one piece: the tensor itself; a stack [E, ...]: its E slices)."""
        h = xxhash.xxh3_128(f"{name}:{tuple(shape)}:{dtype}".encode())
        for piece in pieces:
            h.update(memoryview(piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
        self.parts[name] = h.hexdigest()

    def hexdigest(self) -> str:
        return hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()


def weights_digest(tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype, Iterable[torch.Tensor]]]) -> str:
    """Digest of named tensors given as (name, shape, dtype, pieces) (any order; see `WeightsDigest.add`)."""
    digest = WeightsDigest()
    for name, shape, dtype, pieces in tensors:
        digest.add(name, shape, dtype, pieces)
    return digest.hexdigest()


def identity(config: dict, dtype: torch.dtype, quantization: dict | None, act_quant: bool, weights: str) -> str:
    """The model identity: a hex digest of its config (a JSON-ready dict), compute dtype, quantization config
    files, activation-quantization option and weights digest."""
    header = {"config": config, "dtype": str(dtype), "quantization": quantization, "act_quant": act_quant,
              "weights": weights}
    return hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()
