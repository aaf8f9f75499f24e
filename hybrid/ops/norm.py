"""RMSNorm and the grouped, gated RMSNorm of the Mamba-2 mixer in plain PyTorch: the specification that the
fused CPU kernel (`cpu_norm.cpp`, chosen by `hybrid.ops`) is tested against.

Both compute in fp32 whatever the input and weight dtypes (reference: transformers `NemotronHRMSNorm` /
`NemotronHRMSNormGated`, mamba-ssm `RMSNormGated` with `norm_before_gate=False`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim: x [..., d] (any float dtype), weight [d] ->
    [..., d] in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """`rmsnorm_per_group(x * silu(z)) * weight`, the gate applied before the norm: the last dim `d` split
    into `n_groups` contiguous slices of `d / n_groups`, each normalised on its own (tests/test_cases.py,
    case 3). x [..., d] (fp32 from the scan), z [..., d], weight [d] -> [..., d] in `out_dtype`."""
    g = (x.float() * F.silu(z.float())).unflatten(-1, (n_groups, -1))
    g = F.rms_norm(g, (g.shape[-1],), eps=eps)
    return (g.flatten(-2) * weight.float()).to(out_dtype)
