"""bf16 matrix products on the CPU through oneDNN, with the weight reordered once into its blocked layout.

Why: on an AVX-512-BF16 CPU, oneDNN's inner-product primitive on a prepacked weight reads the weight faster
than eager `x @ W.T` with a bf16 weight when x is a single row (decode), more so for larger matrices, and
runs prompt-sized GEMMs fast too (docs/perf-log.md#onednn-prepacked; `scripts/bench.py` shows the effect
on whole models). This is the path PyTorch's inductor takes for frozen bf16 linears on CPU.
It is one of the two stored forms of the prepacked modules (`moe.quant.kernels.prepacked`'s `PrepackedLinear`,
`PrepackedExpertBank`; `moe.quant.kernels.bf16` picks): the one for CPUs without this project's
bf16 dot-product kernel, which reads Nano's matrices from DRAM faster than this path at one row
(docs/perf-log.md#bf16-decode-kernel).

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
