"""The seam that picks the implementation of the Mamba-2 hot operations (and, from `attention.py`, of attention's).

The plain PyTorch versions (`ssd.py`, `conv1d.py`, `decode.py`, `prefill.py`) are the specification; the mixer calls
one operation per phase: `mamba_scan` (no cache), `mamba_chunks` (prompt chunks of packed sequences),
`mamba_decode_step` (decode tokens). On the GPU path (a CUDA tensor, or any tensor under HYBRID_BACKEND=triton:
`moe.quant.kernels.backend`) all three run in this project's Triton kernels (`triton_mamba.py`) where triton
imports, except that a forward without a cache takes mamba-ssm's chunked scan where the optional `mamba-ssm` package
(extra `mamba-kernels`) imports; without triton, the SSD scan, the recurrent step and the decode conv step take
mamba-ssm's / causal-conv1d's kernels where those import, else PyTorch's versions (or, under
HYBRID_REQUIRE_CUDA_KERNELS=1, the operation raises `KernelUnavailable` naming the import error); on the CPU, the
whole decode step of several sequences (`mamba_decode_step`) and the prompt chunks of several sequences
(`mamba_chunks` through `mamba_chunks_fused`: conv, dt and the SSD in its recurrent form, each state read and
written once per chunk) run in the C++ kernels of `cpu.py` when they build. The scan kernels take the already
processed `dt` (softplus, clamp and padding mask applied before them), so every path shares one definition of `dt`
(tests/test_cases.py, case 1). The RMSNorms (`rms_norm`, `gated_rms_norm`; specification `norm.py`) run in one fused
C++ call per norm on CPU tensors of fp32 / bf16 when no gradient is wanted.
"""

from __future__ import annotations

import functools

import torch

from hybrid.ops import conv1d as _conv
from hybrid.ops import cpu as _cpu
from hybrid.ops import decode as _decode
from hybrid.ops import norm as _norm
from hybrid.ops import prefill as _prefill
from hybrid.ops import ssd as _ssd
from hybrid.ops.attention import (PagedTable, causal_attention, decode_attention, one_query_attention,
                                  paged_decode_attention, triton_attention_module)
from hybrid.ops.conv1d import causal_conv1d
from moe.quant.kernels import backend

__all__ = ["PagedTable", "causal_attention", "causal_conv1d", "conv_step", "decode_attention", "gated_rms_norm", "import_error",
           "kernel_status", "mamba_chunks", "mamba_chunks_fused", "mamba_decode_step", "mamba_scan",
           "one_query_attention", "paged_decode_attention", "rms_norm", "ssd_scan", "ssd_step"]

_IMPORT_ERRORS: dict[str, str] = {}  # package -> why it did not import (`backend.fallback`, `kernel_status`)


@functools.cache
def _mamba_ssm():
    """(mamba_chunk_scan_combined, selective_state_update) from mamba-ssm, or None (the error kept)."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # not installed, built for another torch or CUDA, without its extension
        _IMPORT_ERRORS["mamba-ssm"] = f"{type(e).__name__}: {e}"
        return None
    return mamba_chunk_scan_combined, selective_state_update


@functools.cache
def _causal_conv1d():
    """causal_conv1d_update from causal-conv1d, or None (the error kept)."""
    try:
        from causal_conv1d import causal_conv1d_update
    except Exception as e:
        _IMPORT_ERRORS["causal-conv1d"] = f"{type(e).__name__}: {e}"
        return None
    return causal_conv1d_update


_PACKAGES = {_mamba_ssm: "mamba-ssm", _causal_conv1d: "causal-conv1d"}


def _triton_mamba():
    from hybrid.ops import triton_mamba

    return triton_mamba


def _triton_slots(xBC: torch.Tensor, ssm: torch.Tensor):
    """`hybrid.ops.triton_mamba` when `xBC` takes the GPU path, triton imports, the fp32 state pool has its last
    dim contiguous and no gradient is to be recorded; else None (the CPU kernels or the specification)."""
    if ssm.dtype != torch.float32 or ssm.stride(-1) != 1 or (torch.is_grad_enabled() and xBC.requires_grad):
        return None
    return backend.triton_kernels(xBC, _triton_mamba)


def import_error(package: str) -> str | None:
    """Why `package` ("mamba-ssm" or "causal-conv1d") does not import (its exception, one line), or None when
    it does. Tries the import on the first call."""
    loader = {name: loader for loader, name in _PACKAGES.items()}[package]
    return None if loader() is not None else _IMPORT_ERRORS.get(package, "it does not import")


def _kernel(t, loader):
    """What `loader` provides when `t` takes the GPU path (`backend.gpu_path`) and the package imports; None
    means: use PyTorch (which `backend.fallback` forbids under HYBRID_REQUIRE_CUDA_KERNELS=1)."""
    if not backend.gpu_path(t):
        return None
    kernels = loader()
    if kernels is None:
        backend.fallback(_PACKAGES[loader], import_error(_PACKAGES[loader]))
    return kernels


def kernel_status(gpu_path: bool) -> dict[str, str]:
    """{operation: what runs it} for this module's operations on the GPU path (`gpu_path`) or on the CPU (the
    C++ kernels built now if they are not yet); `hybrid.devices.describe` gathers these."""
    if gpu_path:
        def packages(*names):
            errors = {name: import_error(name) for name in names}
            if not any(errors.values()):
                return " + ".join(names)
            return "PyTorch (" + "; ".join(f"{name} does not import: {e}" for name, e in errors.items() if e) + ")"

        ours = _triton_mamba().available()
        step = "Triton (hybrid.ops.triton_mamba, over the state slots)" if ours else \
            packages("mamba-ssm", "causal-conv1d")
        chunks = "Triton (hybrid.ops.triton_mamba, over the state slots: the chunked SSD for prompts longer than a " \
            "chunk, else the recurrent form; a forward without a " \
            "cache: " + ("mamba-ssm's chunked scan)" if import_error("mamba-ssm") is None else "the same kernels)") \
            if ours else packages("mamba-ssm")
        return {"Mamba-2 prompt scan": chunks,
                "Mamba-2 decode step": step,
                "RMSNorm": "PyTorch",
                "decode attention": "Triton (hybrid.ops.triton_attention, over the paged pool)"
                if triton_attention_module().available() else "PyTorch (each sequence's rows gathered)"}

    def built(ext, what):
        return f"C++ ({what})" if ext is not None else "PyTorch (the C++ kernel did not build or is disabled)"

    return {"Mamba-2 prompt scan": built(_cpu.module(), "cpu_mamba.cpp, fp32 / bf16"),
            "Mamba-2 decode step": built(_cpu.module(), "cpu_mamba.cpp, fp32 / bf16"),
            "RMSNorm": built(_cpu.norm_module(), "cpu_norm.cpp, fp32 / bf16"),
            "decode attention": built(_cpu.attention_module(), "cpu_attention.cpp, fp32 / bf16")}


def ssd_scan(x, dt, A, B, C, chunk_size, state=None):
    """Chunked SSD scan; shapes as in `hybrid.ops.ssd.ssd_scan`. Returns (y fp32, final state fp32)."""
    kernels = _kernel(x, _mamba_ssm)
    if kernels is None:
        return _ssd.ssd_scan(x, dt, A, B, C, chunk_size, state)
    init = None if state is None else state.float()
    y, final = kernels[0](x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), chunk_size,
                          initial_states=init, return_final_states=True)
    return y.float(), final.float()


def ssd_step(x, dt, A, B, C, state):
    """One recurrent step updating `state` in place; shapes as in `hybrid.ops.ssd.ssd_step`."""
    kernels = _kernel(x, _mamba_ssm)
    if kernels is None:
        return _ssd.ssd_step(x, dt, A, B, C, state)
    h, p = x.shape[1:]
    n = B.shape[-1]
    # zero D and dt_bias (the mixer adds D x itself, dt is already final): mamba-ssm 2.3's selective_state_update
    # fails without them (it reads dt_bias's strides when dt and A are broadcast over the head dim, and unpacks
    # D's strides with a misplaced `*`; both seen on an H200)
    zeros = torch.zeros(h, 1, device=x.device, dtype=torch.float32).expand(h, p)
    y = kernels[1](state, x, dt[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n), B, C,
                   D=zeros, dt_bias=zeros)
    return y.float()


def conv_step(x, window, weight, bias):
    """One decode step of the causal conv + SiLU, rolling `window` in place; shapes as in
    `hybrid.ops.conv1d.causal_conv1d_update`."""
    kernel = _kernel(x, _causal_conv1d)
    if kernel is None:
        return _conv.causal_conv1d_update(x, window, weight, bias)
    return kernel(x[:, :, None], window, weight, bias, activation="silu")[:, :, 0]


def mamba_decode_step(xBC, dt, conv, ssm, index, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int,
                      n_groups: int) -> torch.Tensor:
    """One decode token for each of S sequences whose Mamba states are rows `index` of the pools, updated in
    place: conv step + SiLU, dt = clamp(softplus(dt + dt_bias), *time_step_limit), SSD step, + D x.

    Args:
        xBC: [S, conv_dim] the in_proj output's conv part (model dtype); dt: [S, nh] its raw dt part.
        conv: [R, conv_dim, K-1] conv windows (model dtype); ssm: [R, nh, P, N] fp32 states; index: [S] int64
            rows of the S sequences (distinct).
        weight: [conv_dim, K] conv taps; bias: [conv_dim] or None; dt_bias, A (= -exp(A_log)), D: [nh].
    Returns:
        y [S, nh, P] fp32 (the D skip included), what the gated norm reads.

    Kernels: on the GPU path this project's Triton kernels (`triton_mamba.py`: two launches for all S, no host
    round trip), on the CPU the C++ kernel (`cpu_mamba.cpp`), else the specification (`decode.py`, with the
    mamba-ssm / causal-conv1d steps where they import).
    """
    if (kernels := _triton_slots(xBC, ssm)) is not None:
        return kernels.mamba_decode_step(xBC, dt, conv, ssm, index, weight, bias, dt_bias, A, D, time_step_limit,
                                         d_inner, n_groups)
    ext = _cpu.module() if backend.cpu_kernels(xBC) and xBC.dtype in (torch.float32, torch.bfloat16) else None
    if ext is not None and conv.is_contiguous() and ssm.is_contiguous() and ssm.dtype == torch.float32 \
            and conv.dtype == xBC.dtype:
        lo, hi = time_step_limit
        return ext.mamba_step_slots(xBC, dt, conv, weight, bias, dt_bias, A, D, float(lo), float(hi), ssm, index,
                                    d_inner, n_groups)
    return _decode.mamba_decode_step(xBC, dt, conv, ssm, index, weight, bias, dt_bias, A, D, time_step_limit,
                                     d_inner, n_groups, conv_step, ssd_step)


def mamba_chunks_fused(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D, time_step_limit,
                       d_inner: int, n_groups: int) -> torch.Tensor | None:
    """The prompt chunks of S sequences through the conv, dt and SSD recurrences in one C++ call on the CPU
    (`cpu_mamba.cpp`), each continuing and updating its state in place in rows `index` of the pools; or None
    where there is no such kernel (not a CPU tensor of fp32 / bf16, the build failed, a pool is not
    contiguous): the caller then runs the PyTorch prefill (`causal_conv1d` + `ssd_scan`), the specification.

    Args:
        xBC: [L, conv_dim] packed in_proj conv parts (model dtype); dt: [L, nh] their raw dt parts.
        conv, ssm, index, weight, bias, dt_bias, A, D: as in `mamba_decode_step`.
        starts, lengths: [S] int64: sequence s owns rows starts[s] .. starts[s] + lengths[s] - 1 (length >= 1,
            no row in two segments).
    Returns:
        y [L, nh, P] fp32 with the D skip (rows outside the segments zero), or None.
    Raises:
        RuntimeError: a segment outside the L rows, overlapping segments, widths that do not fit the pools.

    Equals the specification up to the order of fp32 sums (tests/test_mamba_kernel.py: 2e-6 of the output's
    scale at Nano widths; the conv windows exactly). Why one call: many short chunks cost it about what one long
    chunk does, where the PyTorch prefill pays per chunk and per padded batch (docs/perf-log.md#mamba-chunk-kernel).
    """
    ext = _cpu.module() if backend.cpu_kernels(xBC) and xBC.dtype in (torch.float32, torch.bfloat16) else None
    if ext is None or not (conv.is_contiguous() and ssm.is_contiguous() and ssm.dtype == torch.float32
                           and conv.dtype == xBC.dtype) or torch.is_grad_enabled() and xBC.requires_grad:
        return None
    lo, hi = time_step_limit
    return ext.mamba_chunks_slots(xBC, dt, conv, weight, bias, dt_bias, A, D, float(lo), float(hi), ssm, starts,
                                  lengths, index, d_inner, n_groups)


def mamba_chunks(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D, time_step_limit,
                 d_inner: int, n_groups: int, chunk_size: int, max_length: int | None = None) -> torch.Tensor:
    """The prompt chunks of S sequences (arguments and result as `mamba_chunks_fused`; `chunk_size`: the SSD
    scan's; `max_length`: the longest segment, a host int, where the caller knows it): on the GPU path this
    project's Triton kernels (`triton_mamba.mamba_chunks`: the recurrent form, or the chunked one for segments
    longer than its chunk when `max_length` says so; no host round trip), on the CPU the C++ kernel where it runs
    (`mamba_chunks_fused`), else the PyTorch specification (`hybrid.ops.prefill.mamba_chunks`: chunks of close
    lengths as right-padded batches, mamba-ssm's scan on the GPU path without triton). Returns y [L, nh, P] fp32
    (rows outside the segments zero)."""
    if (kernels := _triton_slots(xBC, ssm)) is not None:
        return kernels.mamba_chunks(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D,
                                    time_step_limit, d_inner, n_groups, max_length)
    y = mamba_chunks_fused(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D, time_step_limit,
                           d_inner, n_groups)
    if y is not None:
        return y
    return _prefill.mamba_chunks(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D,
                                 time_step_limit, d_inner, n_groups, chunk_size, causal_conv1d, ssd_scan)


def mamba_scan(xBC, dt, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int, n_groups: int, chunk_size: int,
               mask=None, conv=None, ssm=None) -> torch.Tensor:
    """Several tokens of B rows through the conv, dt and the chunked SSD scan (the forward without a cache,
    padding masked: `mask` [B, T] bool, True for real tokens; `conv` / `ssm`: states to continue, updated in
    place): xBC [B, T, conv_dim], dt [B, T, nh] (raw) -> y [B, T, nh, P] fp32 with the D skip (at padded
    positions any value). On the GPU path mamba-ssm's chunked scan where it imports (the optional package,
    selectable by installing it), else this project's Triton kernels (`triton_mamba.mamba_scan`: each row a
    segment of the prompt-chunk kernels, chunked past one chunk), else the specification
    (`hybrid.ops.prefill.mamba_scan`)."""
    if backend.gpu_path(xBC) and _mamba_ssm() is None and (ssm is None or ssm.dtype == torch.float32) and not (
            torch.is_grad_enabled() and xBC.requires_grad) \
            and (kernels := backend.triton_kernels(xBC, _triton_mamba)) is not None:
        return kernels.mamba_scan(xBC, dt, weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups, mask,
                                  conv, ssm)
    return _prefill.mamba_scan(xBC, dt, weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups, chunk_size,
                               causal_conv1d, ssd_scan, mask, conv, ssm)


_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _fused_norm(*tensors):
    """The fused norm extension when every tensor suits it (CPU, fp32 / bf16, no gradient to record), else None."""
    if any(not backend.cpu_kernels(t) or t.dtype not in _FUSED_DTYPES for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return _cpu.norm_module()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; shapes and dtypes as in `hybrid.ops.norm.rms_norm`."""
    ext = _fused_norm(x, weight)
    if ext is None:
        return _norm.rms_norm(x, weight, eps)
    return ext.rms_norm(x.contiguous(), weight.contiguous(), float(eps))


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The Mamba-2 mixer's grouped gated RMSNorm; shapes and dtypes as in `hybrid.ops.norm.gated_rms_norm`."""
    ext = _fused_norm(x, z, weight) if x.dtype == torch.float32 and out_dtype in _FUSED_DTYPES else None
    if ext is None:
        return _norm.gated_rms_norm(x, z, weight, n_groups, eps, out_dtype)
    return ext.gated_rms_norm(x.contiguous(), z.contiguous(), weight.contiguous(), n_groups, float(eps), out_dtype)
