"""The MoE router module: sigmoid scores, bias-corrected grouped top-k selection, renormalised scaled weights.

The selection's rule and its kernels are the operation `moe.quant.kernels.routing.topk_route` (its reference:
`route` there); this module holds the router's parameters under the checkpoint's names.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.quant.kernels.routing import topk_route


class TopkRouter(nn.Module):
    """`gate.weight` [E, H] and `gate.e_score_correction_bias` [E], both kept in fp32.

    Shapes: x [T, H] -> (weights [T, k] fp32, ids [T, k] int64), by `topk_route`.
    """

    def __init__(self, hidden_size: int, n_routed_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_routed_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_routed_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                          self.norm_topk_prob, self.routed_scaling_factor)
