"""The MoE's kernel seam: compute kernels, and the operations that pick one beside their PyTorch reference.

    experts.py    the routed experts: `dispatch` (the reference), `packed_experts` (packed stacks: fused Triton,
                  the CPU extension's grouped products, or the reference)
    routing.py    the router: `route` (the reference), `topk_route` (a decode step's rows in one C++ call,
                  cpu_router.cpp)
    prepacked.py  modules holding bf16 weights in bf16.py's layout (PrepackedLinear, PrepackedExpertBank)
    bf16.py       bf16 matrix products for the prepacked modules (CPU): the extension's dot-product kernel on a
                  plain copy of the weight for decode rows, or oneDNN (onednn.py) on its blocked layout
    onednn.py     bf16 matrix products on prepacked oneDNN weights (CPU)
    cpu.py        FP8 / NVFP4 / MXFP4 products straight from the packed bytes (CPU; the C++ extension
                  cpu_packed.cpp, compiled on first use)
    amx.py        the same products for prefill-sized bf16 inputs on CPUs with AMX (cpu_amx.cpp: slabs decoded to
                  bf16, multiplied by oneDNN's AMX micro-kernel; chosen inside cpu.py), and bf16 experts' (bf16.py)
    triton.py     fused dequantize-matmul for FP8 / NVFP4 / MXFP4 weights, plain or grouped by expert (CUDA)

The PyTorch reference (dequantize the weight, then an ordinary matmul) is what runs wherever no kernel
applies; every kernel is tested against it. `packed_linear` below is the choice for one packed matrix (what
`QuantLinear` calls). Modules outside these seams call the operations; only here is it asked which kernel runs
(tests/test_architecture.py). Private PyTorch operators appear only in these modules (each
module's docstring names the ones it uses; `docs/architecture.md` lists them all).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from moe.quant.kernels import backend


def triton_for(x: torch.Tensor, *fmts) -> ModuleType | None:
    """`moe.quant.kernels.triton` when `x` takes the GPU path (`backend.gpu_path`: a CUDA tensor, or any under
    HYBRID_BACKEND=triton) and the fused kernels support every format in `fmts` (imported on first use, so CPU
    runs never import triton); None means: use the PyTorch path.

    Raises:
        KernelUnavailable: triton does not import and HYBRID_REQUIRE_CUDA_KERNELS=1 (`backend.fallback`).
    """
    triton = backend.triton_kernels(x, _triton)
    return triton if triton is not None and all(triton.supports(f) for f in fmts) else None


def _triton() -> ModuleType:
    from moe.quant.kernels import triton

    return triton


def status(gpu_path: bool) -> dict[str, str]:
    """{operation: what runs it} for the weight products on the GPU path (`gpu_path`) or on this CPU (whose
    kernels are built now if they are not yet); `hybrid.devices.describe` gathers these."""
    if gpu_path:
        from moe.quant.kernels import triton

        fused = "Triton (moe.quant.kernels.triton, weights decoded in registers)" if triton.available() else \
            f"PyTorch: the weight dequantized per call (triton does not import: {triton.IMPORT_ERROR})"
        experts = "Triton (moe.quant.kernels.triton, grouped by expert)" if triton.available() else \
            f"PyTorch: one product per chosen expert (triton does not import: {triton.IMPORT_ERROR})"
        return {"bf16 / fp16 / fp32 products": "PyTorch (torch.matmul)", "bf16 / fp16 / fp32 experts": experts,
                "FP8 / NVFP4 products and experts": fused, "MXFP4 products and experts": fused}
    from moe.quant.kernels import bf16, cpu

    packed = "C++ (cpu_packed.cpp, straight from the packed bytes)" if cpu.module() is not None else \
        "PyTorch: the weight dequantized per call (the C++ kernel did not build or is disabled)"
    bf16_products = ("bf16: prepacked at load (oneDNN; cpu_packed.cpp for decode rows); fp16 / fp32: PyTorch"
                     if bf16.available() else "PyTorch (torch.matmul)")
    return {"bf16 / fp16 / fp32 products": bf16_products, "FP8 / NVFP4 products and experts": packed,
            "MXFP4 products and experts": packed}


def cpu_for(x: torch.Tensor, fmt) -> ModuleType | None:
    """`moe.quant.kernels.cpu` when `x` is a CPU tensor and its kernels support `fmt` and are built (the first
    call builds them); None means: the PyTorch path (dequantize, then matmul)."""
    if not backend.cpu_kernels(x):
        return None
    from moe.quant.kernels import cpu

    return cpu if cpu.supports(fmt) and cpu.module() is not None else None


def packed_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
    """x [..., in] @ dequantize(W).T (+ bias) -> [..., out] in x's dtype, for a packed matrix `weight` (a
    `moe.quant.PackedWeight` of one matrix): the fused Triton kernel on the GPU path (unless `fused` is False:
    inputs already quantize-dequantized, `QuantLinear(act_quant=True)`), the CPU kernel straight from the packed
    bytes, else the reference: the weight dequantized for the call, then `F.linear`."""
    if fused and (triton := triton_for(x, weight.fmt)) is not None:
        return triton.linear(x, weight, bias)
    if (cpu := cpu_for(x, weight.fmt)) is not None:
        y = cpu.linear(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)
        return (y if bias is None else y + bias).to(x.dtype)
    return F.linear(x, weight.dequantize(x.dtype), bias)
