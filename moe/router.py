"""The MoE router: sigmoid scores, bias-corrected grouped top-k selection, renormalised scaled weights.

DeepSeek-V3 style routing as used by Nemotron 3 (reference: transformers `NemotronHTopkRouter`, vLLM
`grouped_topk`). Per token, in fp32:

    scores = sigmoid(x @ gate.weight.T)                      [T, E]
    choice = scores + e_score_correction_bias                 selection only (tests/test_cases.py, case 9)
    groups: score each of `n_group` groups by the sum of its top-2 `choice`; keep `topk_group` groups,
            set the others to -inf; then take the top `num_experts_per_tok` of `choice`
    weights = scores[chosen] (unbiased), / their sum (+1e-20) if `norm_topk_prob`, * routed_scaling_factor

Ties go to the lower expert (and group) id: selection sorts stably in descending order.

On the CPU a router of at most `KERNEL_ROWS` tokens (a decode step) runs in one C++ call (`cpu_router.cpp`:
the product and the selection; built on first use, PyTorch's path otherwise and for longer inputs).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

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


class TopkRouter(nn.Module):
    """`gate.weight` [E, H] and `gate.e_score_correction_bias` [E], both kept in fp32.

    Shapes: x [T, H] -> (weights [T, k] fp32, ids [T, k] int64). `route` of `x.float() @ weight.T`; on the CPU
    for up to `KERNEL_ROWS` tokens the C++ kernel, whose product sums in another order (logits agree to about
    1e-6 relative; a choice that close to a tie may differ).
    """

    def __init__(self, hidden_size: int, n_routed_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_routed_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_routed_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel_takes(x):  # a decode step's few tokens: product and selection in one C++ call
            weights, ids = kernel().route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group,
                                          self.topk_group, self.norm_topk_prob, float(self.routed_scaling_factor))
            return weights, ids
        logits = x.float() @ self.weight.float().T
        return route(logits, self.e_score_correction_bias.float(), self.top_k, self.n_group, self.topk_group,
                     self.norm_topk_prob, self.routed_scaling_factor)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes to the C++ router: a CPU tensor of at most `KERNEL_ROWS` fp32 / bf16 rows, fp32
        contiguous parameters, no autograd (training differentiates the PyTorch path), and the kernel built."""
        return (backend.cpu_kernels(x) and x.dim() == 2 and 0 < x.shape[0] <= KERNEL_ROWS
                and x.dtype in (torch.float32, torch.bfloat16)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and self.weight.dtype == torch.float32 and self.weight.is_contiguous()
                and self.e_score_correction_bias.dtype == torch.float32
                and self.e_score_correction_bias.is_contiguous() and kernel() is not None)
