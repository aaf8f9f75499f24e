"""Triton kernels that fuse dequantization into the matmul: FP8, NVFP4 and MXFP4 weights, plain or grouped by
expert (and dense float expert stacks grouped the same way: `grouped_dense_matmul`).

One kernel computes `out[rows] = x[rows] @ dequant(W_e).T` for row tiles that each belong to one weight
`W_e` of a stack (a plain Linear is a stack of one). Each program loads a [BLOCK_N, BLOCK_K] tile of the
packed weight, decodes it in registers with the format's exact tables (the 256 E4M3 values, the 16
E2M1 values) and scales, and feeds `tl.dot` with fp32 accumulation; no dequantized weight ever exists
in memory. The grouped form (`expert_bank`) sorts token/expert pairs by expert, gives every expert
ceil(count / BLOCK_M) row tiles (`row_tiles`), so that `moe.experts.QuantExpertBank` runs the up and down
projections of all chosen experts as two launches (the MoE layout of vLLM's `fused_moe`, without the
padding buffers).

Weights (`PackedWeight` tensors, row-major as on disk):
    FP8    data e4m3 [E?, N, K]; scale fp32 per tensor [E?], per channel [E?, N] or per 128x128 block
           [E?, ceil(N/128), ceil(K/128)]: element (n, k) uses scale[(n // SBN) * s_n + (k // SBK) * s_k]
    NVFP4  data uint8 [E?, N, K/2] (element k in byte k // 2, nibble k % 2), scale e4m3 [E?, N, K/16],
           global fp32 [E?] (multiplier, or divisor for compressed-tensors)
    MXFP4  data uint8 [E?, N, K/2] as NVFP4's (gpt-oss' [E?, N, K/32, 16] blocks: the same bytes), scale E8M0
           uint8 [E?, N, K/32] (2^(e - 127), 0xFF NaN), no global

Tested on the CPU with `TRITON_INTERPRET=1` against the PyTorch path (tests/test_quant_triton.py).
"""

from __future__ import annotations

import torch

IMPORT_ERROR = ""  # why triton did not import (`moe.quant.kernels.backend.fallback` names it)
try:
    import triton
    import triton.language as tl
except ImportError as e:  # triton is optional (the `cuda` extra)
    triton, IMPORT_ERROR = None, f"{type(e).__name__}: {e}"

from moe.quant.e2m1 import E2M1_VALUES
from moe.quant.e4m3 import e4m3_value
from moe.quant.codec import QuantFormat
from moe.quant.kernels import backend

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
KERNEL_KINDS = {"fp8": 0, "nvfp4": 1, "mxfp4": 3}  # codec name -> the kernel's KIND (how it decodes a weight tile)
DENSE_KIND = 2  # a weight tile read as it is (bf16 / fp16 / fp32 experts)


def available() -> bool:
    return triton is not None


def supports(fmt: QuantFormat | None) -> bool:
    """Whether a weight in `fmt` can run in the fused kernel (weight-only FP8 of any granularity, NVFP4, MXFP4)."""
    return available() and fmt is not None and fmt.codec.name in KERNEL_KINDS


if triton is not None:

    @triton.jit
    def _packed_matmul_kernel(
        x_ptr, out_ptr, w_ptr, s_ptr, g_ptr, e4m3_lut, e2m1_lut,
        tile_expert, tile_start, tile_end,
        N, K, stride_xm, stride_om,
        stride_we, stride_wn, stride_se, stride_sn, stride_sk, sbn, sbk,
        KIND: tl.constexpr, DIVISOR: tl.constexpr, IEEE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert + tile)
        row0 = tl.load(tile_start + tile)
        row1 = tl.load(tile_end + tile)
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < row1
        col_ok = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w_base = w_ptr + e * stride_we
        s_base = s_ptr + e * stride_se
        if KIND == 1:
            g = tl.load(g_ptr + e)
        k_end = tl.where(row1 > row0, K, 0)  # an empty tile (past `row_tiles`' real ones) reads nothing
        for k0 in range(0, k_end, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = col_ok[:, None] & k_ok[None, :]
            if KIND == 2:  # a dense weight in a float dtype
                w = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=wmask, other=0.0)
            elif KIND == 0:
                bits = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=wmask, other=0)
                value = tl.load(e4m3_lut + bits.to(tl.int32))
                sidx = (cols[:, None] // sbn) * stride_sn + (ks[None, :] // sbk) * stride_sk
                scale = tl.load(s_base + sidx, mask=wmask, other=0.0)
                w = value * scale
            else:  # E2M1 codes, two per byte (element k in the low nibble when k is even)
                byte = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :] // 2, mask=wmask, other=0)
                code = (byte.to(tl.int32) >> ((ks[None, :] % 2) * 4)) & 15
                value = tl.load(e2m1_lut + code)
                if KIND == 1:  # NVFP4: an E4M3 scale per 16 inputs, times or divided by the global scale
                    sbits = tl.load(s_base + cols[:, None] * stride_sn + ks[None, :] // 16, mask=wmask, other=0)
                    block_scale = tl.load(e4m3_lut + sbits.to(tl.int32))
                    if DIVISOR:
                        w = value * (block_scale / g)
                    else:
                        w = value * (block_scale * g)
                else:  # MXFP4: an E8M0 scale 2^(e - 127) per 32 inputs; 0xFF is NaN
                    sbits = tl.load(s_base + cols[:, None] * stride_sn + ks[None, :] // 32, mask=wmask, other=0)
                    block_scale = tl.exp2(sbits.to(tl.float32) - 127.0)
                    w = value * tl.where(sbits == 255, float("nan"), block_scale)
            w = tl.where(wmask, w, 0.0).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


_LUTS: dict = {}


def _luts(device) -> tuple[torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _LUTS:
        _LUTS[key] = (torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float32, device=device),
                      torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device))
    return _LUTS[key]


def _scale_layout(proj, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, sbn, sbk) of the projection's block scales."""
    layout, scale = proj.fmt.layout, proj.role("scale")
    stacked = proj.n_experts is not None
    stride_se = scale.stride(0) if stacked else 0
    if proj.fmt.codec.group:  # NVFP4: one scale per `group` inputs of a row
        return stride_se, scale.stride(-2), 1, 1, proj.fmt.codec.group
    if layout.granularity == "tensor":
        return stride_se, 0, 0, N, K
    if layout.granularity == "channel":
        return stride_se, 1, 0, 1, K
    return stride_se, scale.stride(-2), scale.stride(-1), layout.block, layout.block


def grouped_matmul(x: torch.Tensor, proj, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [M, K] (rows grouped by weight) -> [M, N]: each row tile (expert, start, end) times dequant(W_expert).T."""
    N, K = proj.out_features, proj.in_features
    x = x.contiguous()
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    data = proj.role("data")
    w = data.view(torch.uint8)
    if proj.fmt.layout.blocks_layout:  # gpt-oss' [.., N, K/32, 16] blocks: the same bytes as [.., N, K/2]
        w = w.flatten(-2)
    stacked = proj.n_experts is not None
    stride_se, stride_sn, stride_sk, sbn, sbk = _scale_layout(proj, N, K)
    scale = proj.role("scale")
    scale = scale.view(torch.uint8) if scale.dtype in (torch.float8_e4m3fn, torch.uint8) else scale.float()
    g = proj.role("global")
    g = (g.float().reshape(-1) if g is not None else torch.ones(1, device=x.device))
    e4m3_lut, e2m1_lut = _luts(x.device)
    expert, start, end = tiles
    grid = (expert.numel(), triton.cdiv(N, BLOCK_N))
    with backend.launch_guard(x.device):
        _packed_matmul_kernel[grid](
            x, out, w, scale, g, e4m3_lut, e2m1_lut, expert, start, end,
            N, K, x.stride(0), out.stride(0),
            w.stride(0) if stacked else 0, w.stride(-2), stride_se, stride_sn, stride_sk, sbn, sbk,
            KIND=KERNEL_KINDS[proj.fmt.codec.name], DIVISOR=proj.fmt.layout.divisor,
            IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        )
    return out


def grouped_dense_matmul(x: torch.Tensor, weight: torch.Tensor,
                         tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [M, K] (rows grouped by weight) -> [M, N] in x's dtype: each row tile (expert, start, end) times
    weight[expert].T, for a dense stack `weight` [E, N, K] in a float dtype (its elements converted to x's dtype
    in registers; fp32 sums)."""
    E, N, K = weight.shape
    x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    expert, start, end = tiles
    grid = (expert.numel(), triton.cdiv(N, BLOCK_N))
    with backend.launch_guard(x.device):
        _packed_matmul_kernel[grid](
            x, out, weight, weight, weight, weight, weight, expert, start, end,
            N, K, x.stride(0), out.stride(0), weight.stride(0), weight.stride(1), 0, 0, 0, 1, 1,
            KIND=DENSE_KIND, DIVISOR=False, IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        )
    return out


def row_tiles(counts: torch.Tensor, block_m: int = BLOCK_M, max_rows: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert row counts [E] (a device tensor) -> (expert [tiles], start [tiles], end [tiles]) int32, rows
    grouped by expert, every expert's rows in tiles of `block_m`.

    Without a read of `counts` on the host: the number of tiles is the bound ceil(max_rows / block_m) + min(E,
    max_rows) (`max_rows`: the rows' total, a shape the caller knows; by default read from `counts`), and the
    tiles past the real ones are empty (start == end: the kernel skips them), so no step waits for the device.
    """
    E = counts.numel()
    if max_rows is None:
        max_rows = int(counts.sum())
    n_tiles = (counts + block_m - 1) // block_m
    last = torch.cumsum(n_tiles, 0)  # one past each expert's last tile
    ends = torch.cumsum(counts, 0)
    t = torch.arange(-(-max_rows // block_m) + min(E, max_rows), device=counts.device)
    expert = torch.searchsorted(last, t, right=True)  # the first expert whose tiles reach past t
    real = expert < E
    expert = expert.clamp(max=E - 1)
    local = t - (last[expert] - n_tiles[expert])
    start = torch.where(real, ends[expert] - counts[expert] + local * block_m, 0)
    end = torch.where(real, ends[expert], 0)
    return expert.int(), start.int(), end.int()


def linear(x: torch.Tensor, proj, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequant(W), bias)` for a `QuantLinear` (or any single `PackedWeight`), fused."""
    flat = x.reshape(-1, x.shape[-1])
    M = flat.shape[0]  # one weight: the tiles from the shape alone, made on the device
    start = torch.arange(0, M, BLOCK_M, device=x.device, dtype=torch.int32)
    tiles = (torch.zeros_like(start), start, torch.full_like(start, M))
    out = grouped_matmul(flat, proj, tiles)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], proj.out_features)
