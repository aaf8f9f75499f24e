"""The MoE router's selection as an operation choosing its kernel beside its reference (`route`).

DeepSeek-V3 style routing as used by Nemotron 3 (reference: transformers `NemotronHTopkRouter`, vLLM
`grouped_topk`). Per token, in fp32:

    scores = sigmoid(x @ gate.weight.T)                      [T, E]
    choice = scores + e_score_correction_bias                 selection only (tests/test_cases.py, case 9)
    groups: score each of `n_group` groups by the sum of its top-2 `choice`; keep `topk_group` groups,
            set the others to -inf; then take the top `num_experts_per_tok` of `choice`
    weights = scores[chosen] (unbiased), / their sum (+1e-20) if `norm_topk_prob`, * routed_scaling_factor

Ties go to the lower expert (and group) id: selection sorts stably in descending order.

`topk_route` runs it: on the CPU at most `KERNEL_ROWS` tokens (a decode step) in one C++ call
(`cpu_router.cpp`: the product and the selection; built on first use), else `route` of PyTorch's product.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from moe.quant.kernels import backend

SOURCE = Path(__file__).with_name("cpu_router.cpp")
KERNEL_ROWS = 16  # the most tokens routed by the C++ kernel; a prefill chunk's product is a BLAS GEMM's work


@functools.cache
def kernel():
    """The compiled router extension (`cpu_router.cpp`), built on first use; None when it is disabled
    (`HYBRID_CPU_KERNELS=0`) or cannot be built."""
    from moe.quant.kernels.build import build

    return build(SOURCE, "hybrid_router", what="the MoE router kernel")


def route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts from router logits.

    Args:
        logits: [T, E] fp32 router logits.
        correction_bias: [E] fp32 `e_score_correction_bias`.
    Returns:
        weights [T, top_k] fp32 and expert ids [T, top_k] int64, ordered by decreasing `choice` score.
    """
    T, E = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + correction_bias
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def topk_route(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int = 1,
               topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of `x.float() @ weight.float().T`: x [T, H], weight [E, H], correction_bias [E] -> (weights
    [T, top_k] fp32, ids [T, top_k] int64). On the CPU for up to `KERNEL_ROWS` tokens the C++ kernel, whose
    product sums in another order (logits agree to about 1e-6 relative; a choice that close to a tie may
    differ)."""
    if _kernel_takes(x, weight, correction_bias):  # a decode step's few tokens: product and selection in one call
        return kernel().route(x, weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                              float(routed_scaling_factor))
    logits = x.float() @ weight.float().T
    return route(logits, correction_bias.float(), top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether `x` goes to the C++ router: a CPU tensor of at most `KERNEL_ROWS` fp32 / bf16 rows, fp32
    contiguous parameters, no autograd (training differentiates the PyTorch path), and the kernel built."""
    return (backend.cpu_kernels(x) and x.dim() == 2 and 0 < x.shape[0] <= KERNEL_ROWS
            and x.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and weight.dtype == torch.float32 and weight.is_contiguous()
            and bias.dtype == torch.float32 and bias.is_contiguous() and kernel() is not None)
