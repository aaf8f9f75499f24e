"""The MoE layer (`E`): router, routed experts (optionally in a latent space), and one shared expert.

    w, ids = router(x)
    routed = fc2_latent_proj(experts(fc1_latent_proj(x), w, ids))     (latent projections only with moe_latent_size)
    out = routed + shared_experts(x)                                   (the shared expert sees the full x)

Under tensor parallelism (`hybrid.parallel`) `experts` holds one rank's experts from `expert_offset` on: ids
of other ranks' experts fall outside the bank and are skipped (`moe.dispatch`).

The Nemotron-specific assembly of the model-agnostic parts in `moe` (router maths, expert banks, dispatch).
Reference: transformers `NemotronHMoE`, vLLM `NemotronHMoE`.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.config import HybridConfig
from hybrid.layers.mlp import MLP
from moe.experts import ExpertBank
from moe.router import TopkRouter


class MoE(nn.Module):
    """Shapes: x [B, T, hidden_size] -> [B, T, hidden_size]."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        H, latent = config.hidden_size, config.moe_latent_size
        self.gate = TopkRouter(H, config.n_routed_experts, config.num_experts_per_tok, config.n_group,
                               config.topk_group, config.norm_topk_prob, config.routed_scaling_factor)
        self.experts = ExpertBank(config.n_routed_experts, latent or H, config.moe_intermediate_size)
        self.shared_experts = (
            MLP(H, config.moe_shared_expert_intermediate_size, bias=config.mlp_bias) if config.n_shared_experts else None
        )
        self.fc1_latent_proj = nn.Linear(H, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, H, bias=config.mlp_bias) if latent else None
        self.expert_offset = 0  # the global id of `experts`' first expert (a rank's share under `hybrid.parallel`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        u = self.fc1_latent_proj(flat) if self.fc1_latent_proj is not None else flat
        routed = self.experts(u, weights, ids - self.expert_offset if self.expert_offset else ids)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
