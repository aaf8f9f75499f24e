"""Model identity: a digest naming a model's weights and everything else that changes its numbers.

Caches keyed by it (the prefix cache's files) are never used for a model they were not made from.

    identity = sha256(config.json's content, dtype, quantization config, act_quant, weights digest)
    weights digest = sha256 over the tensors sorted by name of (name, shape, dtype, sample of its bytes)

The sample is every byte of a tensor up to 64 KiB, and beyond that a 256-byte window every 64 KiB plus the
last 256 bytes: 1/256 of a large tensor, spread over all of it (each expert of a stacked bank, each block of
rows). A retrained or fine-tuned copy, another quantization or another dtype gives another identity; an
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
    """The bytes of `t` that its fingerprint reads (see the module docstring)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n <= WHOLE_BYTES:
        return flat.cpu().numpy().tobytes()
    count = (n - WINDOW) // STRIDE + 1
    windows = flat.as_strided((count, WINDOW), (STRIDE, 1))
    return windows.cpu().numpy().tobytes() + flat[n - WINDOW:].cpu().numpy().tobytes()


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of named tensors (any order; each may be dropped by the caller right after it is read)."""
    parts = {}
    for name, t in tensors:
        h = hashlib.sha256(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(tensor_sample(t))
        parts[name] = h.hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def identity(config: dict, dtype: torch.dtype, quantization: dict | None, act_quant: bool, weights: str) -> str:
    """The model identity: a hex digest of its config (a JSON-ready dict), compute dtype, quantization config
    files, activation-quantization option and weights digest."""
    header = {"config": config, "dtype": str(dtype), "quantization": quantization, "act_quant": act_quant,
              "weights": weights}
    return hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()
