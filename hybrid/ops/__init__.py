"""The seam that picks the implementation of the Mamba-2 hot operations.

The plain PyTorch versions (`ssd.py`, `conv1d.py`) are the specification and what runs on the CPU. On a
CUDA tensor, when the `mamba-ssm` package (extra `cuda`) is importable, the SSD scan and the recurrent
step use its Triton kernels instead; both take the already processed `dt` (softplus, clamp and padding
mask applied by the mixer), so every path shares one definition of `dt` (cases.md case 1).
"""

from __future__ import annotations

import functools

import torch

from hybrid.ops import ssd as _ssd
from hybrid.ops.conv1d import causal_conv1d

__all__ = ["causal_conv1d", "ssd_scan", "ssd_step", "kernels_available"]


@functools.cache
def _mamba_ssm():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or built for another CUDA: the PyTorch path is always correct
        return None
    return mamba_chunk_scan_combined, selective_state_update


def kernels_available(t: torch.Tensor) -> bool:
    """True when `t` is on CUDA and mamba-ssm's kernels can be imported."""
    return t.is_cuda and _mamba_ssm() is not None


def ssd_scan(x, dt, A, B, C, chunk_size, state=None):
    """Chunked SSD scan; shapes as in `hybrid.ops.ssd.ssd_scan`. Returns (y fp32, final state fp32)."""
    if kernels_available(x):
        scan, _ = _mamba_ssm()
        init = None if state is None else state.float()
        y, final = scan(x, dt, A.float(), B, C, chunk_size, initial_states=init, return_final_states=True)
        return y.float(), final.float()
    return _ssd.ssd_scan(x, dt, A, B, C, chunk_size, state)


def ssd_step(x, dt, A, B, C, state):
    """One recurrent step updating `state` in place; shapes as in `hybrid.ops.ssd.ssd_step`."""
    if kernels_available(x):
        _, step = _mamba_ssm()
        h, p = x.shape[1:]
        n = B.shape[-1]
        y = step(state, x, dt[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n), B, C)
        return y.float()
    return _ssd.ssd_step(x, dt, A, B, C, state)
