"""bf16 matrix products on the CPU for the prepacked modules (`moe.quant.kernels.prepacked`: `PrepackedLinear`,
`PrepackedExpertBank`): `x @ W.T (+ bias)`, bf16 operands, fp32 sums, bf16 result.

A weight is stored, once, in one of two forms (`pack`), and every product dispatches on the form:

    plain    the [out, in] matrix as it is, where the packed-weight extension has its bf16 kernel
             (`moe.quant.kernels.cpu`: AVX512_BF16 + AVX512_VBMI dot products, or on AVX-512 CPUs without
             them and on AVX2 + FMA ones, the weights widened to fp32 in registers, as llama.cpp's AVX2 path
             does; where oneDNN emulates bf16, as on AVX-512 without AVX512_BF16, PyTorch's bf16 product
             is slower than its fp32 one: docs/perf-log.md#bf16-avx512-widen). Inputs of up to
             `DECODE_ROWS` rows (decode) run there, streaming the weight from DRAM faster than oneDNN's
             prepacked product on AVX-512 (docs/perf-log.md#bf16-decode-kernel) and than PyTorch's
             `F.linear` on AVX2 (docs/perf-log.md#bf16-avx2); on a CPU with AMX, those of `amx.MIN_ROWS`
             (8) to 16 rows (a server's decode step) take the AMX tiles instead (`amx.bf16_linear_group`),
             where the register kernel is bound by its dot products (docs/perf-log.md#amx-bf16-rows).
             Larger inputs run PyTorch's matmul, close to oneDNN's prepacked GEMM at prompt sizes
             (docs/perf-log.md#bf16-decode-kernel), except a group of experts' inputs on a CPU with AMX:
             one call of `amx.bf16_linear_group` over all of them, faster than one `F.linear` per expert
             (docs/perf-log.md#amx-bf16-experts); without AVX512_BF16 (AVX2, or AVX-512 alone), where
             PyTorch's bf16 GEMM is several times slower than its fp32 one, fp32 GEMMs on 8 MB tiles of the
             weight widened to fp32 (`_fp32_tiles`, one tile buffer per call; docs/perf-log.md#bf16-avx2).
             Nothing is copied: a weight read from a checkpoint stays a view of its read-only memory map
             (as llama.cpp maps its GGUF), so loading does not touch the bytes and the first forward reads
             them from the OS page cache; the model and the page cache share one copy. (The checkpoint
             files must then not be rewritten in place while the model lives; this project's writer
             replaces files atomically.)
    oneDNN   oneDNN's blocked layout (`moe.quant.kernels.onednn`) on other CPUs with oneDNN bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.quant.kernels import amx, cpu, onednn

DECODE_ROWS = 16  # inputs with at most this many rows take the dot-product kernel (plain form)
PREFILL_TILE_BYTES = 8 << 20  # the fp32 tile of a weight widened at a time for larger inputs on AVX2


def plain_kernel():
    """The extension when it has the bf16-weight kernel on this CPU (`bf16_weights()`), else None."""
    ext = cpu.module()
    return ext if ext is not None and ext.bf16_weights() else None


def available() -> bool:
    """True when bf16 weights can be packed here (either form)."""
    return plain_kernel() is not None or onednn.available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 (CPU; possibly a view of a memory-mapped file) -> its stored form: `weight`
    itself when contiguous (plain: shared, never written), or an opaque oneDNN tensor (a copy)."""
    weight = weight.detach()
    if plain_kernel() is not None:
        return weight.contiguous()
    return onednn.pack(weight)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] bf16 weight of a stored form (a copy)."""
    return packed.to_dense() if packed.is_mkldnn else packed.clone()


def dense(packed: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] bf16 weight of a stored form, for reading only: the stored tensor itself when
    plain (never write into it), a copy from oneDNN's layout."""
    return packed.to_dense() if packed.is_mkldnn else packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """`x @ W.T + bias`, then ReLU when `relu`: x [..., in] bf16, packed from `pack(W)` -> [..., out] bf16."""
    if packed.is_mkldnn:
        return onednn.linear(x, packed, bias, relu)
    if x.numel() <= DECODE_ROWS * x.shape[-1]:
        rows = _rows(x)
        if amx.applies_bf16(rows, packed):  # 8-16 rows: the register kernel is bound by its dot products there
            return _from_kernel(x, amx.bf16_linear_group([rows], [packed])[0], bias, relu)
        return _from_kernel(x, plain_kernel().bf16_linear(rows, packed), bias, relu)
    if not plain_kernel().bf16_inputs():  # no AVX512_BF16: PyTorch's bf16 GEMM runs at a fifth of its fp32 one
        return _from_kernel(x, _fp32_tiles(_rows(x), packed), bias, relu)
    y = F.linear(x, packed, bias)
    return (torch.relu(y) if relu else y).to(torch.bfloat16)


def linear_group(xs: list[torch.Tensor], packs: list[torch.Tensor], relu: bool = False) -> list[torch.Tensor]:
    """`[linear(x, p, relu=relu) for x, p in zip(xs, packs)]` (no bias), in as few calls as the forms allow when
    every form is plain: the inputs of at most `DECODE_ROWS` rows in one kernel call over all their weights (the
    k experts a decoded token chose: one fork of the threads instead of k, balanced over all of them), and on a
    CPU with AMX those of at least `amx.MIN_ROWS` rows (a prefill chunk's experts, a busy decode step's) in one call
    of `amx.bf16_linear_group`."""
    ext = plain_kernel()
    if ext is None or any(p.is_mkldnn for p in packs):
        return [linear(x, p, relu=relu) for x, p in zip(xs, packs)]
    rows = {}  # one view per distinct input, so the extension widens a shared x once
    for x in xs:
        if id(x) not in rows:
            rows[id(x)] = _rows(x)
    tiled, small = [], []  # the inputs for amx.bf16_linear_group, and those for the register kernel
    for i, x in enumerate(xs):
        if amx.applies_bf16(rows[id(x)], packs[i]):
            tiled.append(i)
        elif x.numel() <= DECODE_ROWS * x.shape[-1]:
            small.append(i)
    ys: list[torch.Tensor | None] = [None] * len(xs)  # fp32 results of the kernels
    for idx, run in ((small, ext.bf16_linear_group), (tiled, amx.bf16_linear_group)):
        if idx:
            for i, y in zip(idx, run([rows[id(xs[i])] for i in idx], [packs[i] for i in idx])):
                ys[i] = y
    if len(xs) > 1 and all(y is not None for y in ys) and len({y.shape[-1] for y in ys}) == 1:
        # one width (a decoded token's experts): the ReLU and the conversion once over all the rows
        y = torch.cat(ys)
        out = (y.relu_() if relu else y).to(torch.bfloat16).split([t.shape[0] for t in ys])
        return [o if o.dim() == x.dim() else o.view(*x.shape[:-1], o.shape[-1]) for x, o in zip(xs, out)]
    return [_from_kernel(x, y, None, relu) if y is not None else linear(x, p, relu=relu)
            for x, y, p in zip(xs, ys, packs)]


def _fp32_tiles(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, K] bf16 @ w [N, K] bf16 .T -> [R, N] fp32 through fp32 GEMMs on `PREFILL_TILE_BYTES` of w widened
    at a time (exact products, fp32 sums, as the kernel's; no whole fp32 copy of w), each written into its
    columns of the row-major result. Without AVX512_BF16, at prompt sizes of Nano's projections, far faster
    than PyTorch's bf16 `F.linear` and no slower than the decode kernel (docs/perf-log.md#bf16-avx2)."""
    xf = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    step = max(1, PREFILL_TILE_BYTES // (4 * w.shape[1]))
    tile = torch.empty(min(step, w.shape[0]), w.shape[1], dtype=torch.float32, device=x.device)
    for n0 in range(0, w.shape[0], step):
        part = w[n0:n0 + step]
        wide = tile[:part.shape[0]].copy_(part)
        torch.mm(xf, wide.T, out=out[:, n0:n0 + step])
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the contiguous [rows, in] the kernel takes."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _from_kernel(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
    """The kernel's fp32 [rows, out] (a fresh tensor, changed in place) for x [..., in] -> [..., out] bf16,
    contiguous, the bias added and ReLU applied first. (When the fp32 tiles returned a transposed view, its
    layout, tokens innermost, reached the attention, and PyTorch's CPU attention ran several times slower on
    it than on a contiguous one: docs/perf-log.md#fp32-tiles-row-major.)"""
    if bias is not None:
        y = y.add_(bias)
    if relu:
        y = y.relu_()
    out = torch.empty(*x.shape[:-1], y.shape[-1], dtype=torch.bfloat16, device=y.device)
    out.view(-1, y.shape[-1]).copy_(y)
    return out
