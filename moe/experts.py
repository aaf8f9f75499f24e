"""The routed expert bank: every expert resident as stacked tensors, only the selected ones computed.

Experts are non-gated squared-ReLU MLPs (`y = down(relu(up(x)) ** 2)`, no gate_proj). Checkpoints store one
tensor per expert (`experts.{j}.up_proj.weight`); the loader stacks them into `up_proj [E, I, L]` and
`down_proj [E, L, I]` (L = hidden_size, or moe_latent_size with latent projections).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn



def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, `relu(x) ** 2` (So et al. 2021, Primer); the same as `hybrid.layers.mlp.relu2`, defined
    here so that `moe` imports without `hybrid`."""
    return torch.relu(x).square()


class ExpertBank(nn.Module):
    """Shapes: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L] in x's dtype (summed in fp32).

    The (token, expert) pairs are sorted by expert (a stable sort of the flattened ids) and gathered once;
    each expert that received tokens runs one matmul pair over its contiguous slice; experts nobody chose
    are never touched. Weighted outputs are summed per token in fp32.
    """

    def __init__(self, n_experts: int, in_features: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(n_experts, intermediate_size, in_features))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, in_features, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return dispatch(x, weights, ids, self.up_proj.shape[0],
                        lambda e, part: relu2(part @ self.up_proj[e].T) @ self.down_proj[e].T)


def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int,
             expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run `expert(e, x_e)` for every expert e that some token chose, and combine: x [T, L], weights [T, k]
    fp32, ids [T, k] -> [T, L] in x's dtype.

    The (token, expert) pairs are sorted by expert (a stable sort of the flattened ids) and gathered once;
    each chosen expert gets its contiguous slice `x_e` [n_e, L]; the weighted outputs are summed per token
    in fp32. A single token skips the sort: its k experts run in turn. Shared by the float bank, the
    quantized one (`moe.quant.QuantExpertBank`) and the oneDNN-prepacked one (`hybrid.ops.onednn`).
    """
    T, k = ids.shape
    if T == 1:  # one token (decode at batch 1): its k experts in turn, nothing to sort or scatter
        y = torch.zeros(1, x.shape[-1], dtype=torch.float32, device=x.device)
        for e, w in zip(ids[0].tolist(), weights[0].tolist()):
            y.add_(expert(e, x).float(), alpha=w)
        return y.to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    token_of = order // k
    parts = torch.split(x[token_of], counts)
    ys = [expert(e, part) for e, part in enumerate(parts) if counts[e]]
    y = torch.cat(ys).float() * weights.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device).index_add_(0, token_of, y).to(x.dtype)
