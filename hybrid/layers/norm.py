"""RMSNorm and the grouped, gated RMSNorm of the Mamba-2 mixer.

Both compute in fp32 whatever the weight dtype and return the input dtype (reference: transformers
`NemotronHRMSNorm` / `NemotronHRMSNormGated`, mamba-ssm `RMSNormGated` with `norm_before_gate=False`); the
math is `hybrid.ops.norm`'s, through the `hybrid.ops` seam (a fused CPU kernel where it applies).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid import ops


class RMSNorm(nn.Module):
    """`y = x * rsqrt(mean(x^2) + eps) * weight` over the last dim.

    Shapes: x [..., hidden_size] (any float dtype) -> [..., hidden_size] in x's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Grouped gated RMSNorm: `y = rmsnorm_per_group(x * silu(z)) * weight`, the gate applied before the norm.

    The last dim (`d_inner`) is split into `n_groups` contiguous slices of `d_inner / n_groups`, each
    normalised on its own (tests/test_cases.py, case 3).

    Shapes: x [..., d_inner] (fp32 from the scan), z [..., d_inner] -> [..., d_inner] in `out_dtype`.
    """

    def __init__(self, d_inner: int, n_groups: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_inner))
        self.n_groups = n_groups
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.n_groups, self.eps, out_dtype)
