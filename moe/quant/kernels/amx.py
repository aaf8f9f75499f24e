"""Prefill-sized FP8 / NVFP4 / MXFP4 products on CPUs with AMX (`cpu_amx.cpp`): each weight decoded a slab of 64
rows at a time into a short-lived bf16 buffer (344 KB per thread at Nano's width) and multiplied on the AMX tiles
by PyTorch's oneDNN micro-kernel, bf16 inputs, fp32 sums; no dequantized copy of a whole weight is ever made.
Exact like the register kernels of `cpu.py` (every decoded value is exact in bf16; the scales a bf16 cannot hold
multiply the fp32 sums): the result equals the product with the exactly dequantized weight up to the order of
the fp32 sums.

Where it applies (`moe.quant.kernels.cpu.linear_group` asks): a bf16 input of at least `MIN_ROWS` rows (a
prefill chunk, or an expert's share of one), FP8 with per-tensor or per-channel scales, NVFP4, MXFP4 (not a
weight with a scale byte 0, 1 or 255), K a multiple of 32, and a CPU with AMX_BF16 on which PyTorch's oneDNN
runs its AMX micro-kernels. Elsewhere the register kernels run. Why: at prefill sizes the AMX tiles beat the
register kernels on Nano's matrices (docs/perf-log.md#amx-prefill).

bf16 weights (`bf16_linear_group`: a bf16 model's experts and dense projections of 8 rows or more, from
`moe.quant.kernels.bf16`) take the same loop with their rows as the A operand where they lie (32 rows a call for
inputs of at most 16 rows): nothing decoded or copied.

Built on first use like the register kernels (`moe.quant.kernels.build`: keyed on the source, torch and this
CPU); never on a CPU without AMX. Private PyTorch API used here (and nowhere else): `at::native::cpublas::brgemm`,
`brgemm_release` and `could_pack` (C++).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from moe.quant.kernels.build import FLAGS, build, cpu_flags

SOURCE = Path(__file__).with_name("cpu_amx.cpp")
MIN_ROWS = 8  # below, the register kernels are faster on Nano's matrices (decoding the slabs is this path's fixed
# cost): docs/perf-log.md#amx-rows


@functools.cache
def module():
    """The compiled extension, or None: no AMX_BF16 on this CPU, kernels disabled (`HYBRID_CPU_KERNELS=0`), no
    compiler, or a PyTorch whose oneDNN does not run AMX micro-kernels here; `HYBRID_AMX_KERNELS=0` turns this
    path off alone."""
    if "amx_bf16" not in cpu_flags().split() or os.environ.get("HYBRID_AMX_KERNELS", "1") == "0":
        return None
    ext = build(SOURCE, "hybrid_amx", FLAGS, "the AMX kernels")
    return ext if ext is not None and ext.available() else None


def applies(x: torch.Tensor, fmt) -> bool:
    """Whether `x` (rows, K) and `fmt` are this path's (see the module docstring); builds the extension on the
    first call that could use it."""
    name, K = fmt.codec.name, x.shape[-1]
    if x.dtype != torch.bfloat16 or x.shape[0] < MIN_ROWS or K % 32:
        return False
    if name == "fp8" and fmt.layout.granularity == "block" or name not in ("fp8", "nvfp4", "mxfp4"):
        return False
    return module() is not None


def applies_bf16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x (rows, K) @ w.T with w a plain bf16 weight [N, K] (`moe.quant.kernels.bf16`'s plain form) is this
    path's: x bf16 of at least `MIN_ROWS` rows, K a multiple of 32, a CPU with AMX."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and not w.is_mkldnn and x.dim() == 2
            and x.shape[0] >= MIN_ROWS and x.shape[-1] % 32 == 0 and module() is not None)


def bf16_linear_group(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x @ w.T (fp32) for each x bf16 [R, K] and bf16 weight w [N, K]] in one parallel loop: the weights' rows
    are the micro-kernel's A operand where they lie (a view of the checkpoint's map: nothing decoded or copied)."""
    return list(module().bf16_linear_group([x.contiguous() for x in xs], [w.contiguous() for w in ws]))


def linear_group(xs: list[torch.Tensor], ts: list[dict[str, torch.Tensor]], fmt) -> list[torch.Tensor | None]:
    """[x @ W.T (fp32) for each x bf16 [R, K] and W's packed tensors {role: tensor} (contiguous)] in one parallel
    loop; None where this path does not compute it (an MXFP4 weight with an extreme scale byte)."""
    ext, name = module(), fmt.codec.name
    xs = [x.contiguous() for x in xs]
    if name == "fp8":
        scales = [t["scale"].float().contiguous().reshape(-1) for t in ts]  # one value, or one per output row
        ys = ext.fp8_linear_group(xs, [t["data"] for t in ts], scales)
    elif name == "nvfp4":  # ModelOpt's global multiplies, compressed-tensors' divides (1 / g in double)
        gs = [float(t["global"].float()) for t in ts]
        mults = [1.0 / g if fmt.layout.divisor else g for g in gs]
        ys = ext.fp4_linear_group(xs, [t["data"] for t in ts], [t["scale"] for t in ts], fmt.codec.group, False, mults)
    else:
        ys = ext.fp4_linear_group(xs, [t["data"] for t in ts], [t["scale"] for t in ts], fmt.codec.group, True, [])
    return list(ys)  # (an undefined tensor arrives as None)
