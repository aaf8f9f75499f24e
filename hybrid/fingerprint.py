"""Model identity: a digest naming a model's weights and everything else that changes its numbers.

Caches keyed by it (the prefix cache's files) are never used for a model they were not made from.

    identity = sha256(config.json's content, dtype, quantization config, act_quant, weights digest)
    weights digest = sha256 over the tensors sorted by name of (name, shape, dtype, sample of its bytes)

The sample is every byte of a tensor up to 64 KiB, and beyond that a 256-byte window every 64 KiB plus the
last 256 bytes: 1/256 of a large tensor, spread over all of it (each block of rows); a stacked expert bank
is sampled expert by expert. A retrained or fine-tuned copy, another quantization or another dtype gives another identity; an
edit confined to a few rows of one large matrix may not. The digest is taken once, from the tensors as they
are loaded (before any prepacking), so a prepacked model needs no dense copies to name itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch

WHOLE_BYTES = 64 * 1024  # tensors up to this size are hashed whole
WINDOW = 256  # bytes per sampled window of a larger tensor
STRIDE = 64 * 1024  # one window per this many bytes


def tensor_sample(t: torch.Tensor) -> bytes:
    """The bytes of `t` that its fingerprint reads (see the module docstring). A stack of matrices
    ([E, out, in], an expert bank) is read matrix by matrix, so the sample of a stack equals the samples of
    its slices joined: a loader holding one expert at a time takes the same digest."""
    if t.dim() >= 3:
        return b"".join(tensor_sample(t[i]) for i in range(t.shape[0]))
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n <= WHOLE_BYTES:
        return flat.cpu().numpy().tobytes()
    count = (n - WINDOW) // STRIDE + 1
    windows = flat.as_strided((count, WINDOW), (STRIDE, 1))
    return windows.cpu().numpy().tobytes() + flat[n - WINDOW:].cpu().numpy().tobytes()


class WeightsDigest:
    """The weights digest, built one tensor (or one slice of a stacked tensor) at a time."""

    def __init__(self):
        self.parts: dict[str, str] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, sample: bytes) -> None:
        """Tensor `name` of `shape` and `dtype` whose `tensor_sample` is `sample`."""
        h = hashlib.sha256(f"{name}:{tuple(shape)}:{dtype}".encode())
        h.update(sample)
        self.parts[name] = h.hexdigest()

    def hexdigest(self) -> str:
        return hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of named tensors (any order; each may be dropped by the caller right after it is read)."""
    digest = WeightsDigest()
    for name, t in tensors:
        digest.add(name, tuple(t.shape), t.dtype, tensor_sample(t))
    return digest.hexdigest()


def identity(config: dict, dtype: torch.dtype, quantization: dict | None, act_quant: bool, weights: str) -> str:
    """The model identity: a hex digest of its config (a JSON-ready dict), compute dtype, quantization config
    files, activation-quantization option and weights digest."""
    header = {"config": config, "dtype": str(dtype), "quantization": quantization, "act_quant": act_quant,
              "weights": weights}
    return hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()
