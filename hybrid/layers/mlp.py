"""The non-gated squared-ReLU MLP: dense `-` layers and the MoE's shared expert.

`y = down_proj(relu(up_proj(x)) ** 2)` (`mlp_hidden_act: relu2`; transformers `NemotronHMLP`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe import relu2


class MLP(nn.Module):
    """Shapes: x [..., hidden_size] -> [..., hidden_size]; weights up [I, H], down [H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))
