"""bf16 matrix products on the CPU through oneDNN, with the weight reordered once into its blocked layout.

Why: on an AVX-512-BF16 CPU (2 threads), eager `x @ W.T` with a bf16 weight reads the weight at 20-26 GB/s
when x is a single row (decode), while oneDNN's inner-product primitive on a prepacked weight reads it at
28 GB/s (640 x 1024, an expert) to 46 GB/s (12352 x 2048), and runs prompt-sized GEMMs at about 430
GFLOP/s (measured; `scripts/bench.py` shows the effect on whole models). This is the path PyTorch's
inductor takes for frozen bf16 linears on CPU. It is one of the two stored forms of the prepacked modules
(`moe.quant.prepacked.PrepackedLinear`, `moe.experts.PrepackedExpertBank`; `moe.quant.kernels.bf16` picks):
the one for CPUs without this project's bf16 dot-product kernel (on Nano's matrices from DRAM, at one row,
that kernel reads 30-46 GB/s where this path reads 19-31 in the same run).

Private PyTorch operators used here (and nowhere else): `torch.ops.mkldnn._reorder_linear_weight`,
`torch.ops.mkldnn._linear_pointwise`, `torch.ops.mkldnn._is_mkldnn_bf16_supported`.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """True when this PyTorch build has oneDNN with bf16 support on this CPU (AVX-512-BF16 or AMX)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 (CPU) -> the same matrix as an opaque oneDNN tensor in its blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """`x @ W.T + bias` (then ReLU when `relu`): x [..., in] bf16, packed from `pack(W)` -> [..., out] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "relu" if relu else "none", [], "")
