"""Low-level compute kernels for the packed modules, and the seam that picks one.

    bf16.py     bf16 matrix products for the prepacked modules (CPU): the extension's dot-product kernel on a
                plain copy of the weight for decode rows, or oneDNN (onednn.py) on its blocked layout
    onednn.py   bf16 matrix products on prepacked oneDNN weights (CPU)
    cpu.py      FP8 / NVFP4 / MXFP4 products straight from the packed bytes (CPU; the C++ extension
                cpu_packed.cpp, compiled on first use)
    amx.py      the same products for prefill-sized bf16 inputs on CPUs with AMX (cpu_amx.cpp: slabs decoded to
                bf16, multiplied by oneDNN's AMX micro-kernel; chosen inside cpu.py), and bf16 experts' (bf16.py)
    triton.py   fused dequantize-matmul for FP8 / NVFP4 weights, plain or grouped by expert (CUDA)

The PyTorch reference (dequantize the weight, then an ordinary matmul) is what runs wherever no kernel
applies; every kernel is tested against it. Private PyTorch operators appear only in these modules (each
module's docstring names the ones it uses; `docs/architecture.md` lists them all).
"""

from __future__ import annotations

from types import ModuleType

import torch


def triton_for(x: torch.Tensor, *fmts) -> ModuleType | None:
    """`moe.quant.kernels.triton` when `x` is a CUDA tensor and the fused kernels support every format in
    `fmts` (imported on first use, so CPU runs never import triton); None means: use the PyTorch path."""
    if not x.is_cuda:
        return None
    from moe.quant.kernels import triton

    return triton if all(triton.supports(f) for f in fmts) else None


def cpu_for(x: torch.Tensor, fmt) -> ModuleType | None:
    """`moe.quant.kernels.cpu` when `x` is a CPU tensor and its kernels support `fmt` and are built (the first
    call builds them); None means: the PyTorch path (dequantize, then matmul)."""
    if x.device.type != "cpu":
        return None
    from moe.quant.kernels import cpu

    return cpu if cpu.supports(fmt) and cpu.module() is not None else None
