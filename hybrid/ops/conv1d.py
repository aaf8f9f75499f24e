"""The depthwise causal conv1d of the Mamba-2 mixer, with its rolling window, in plain PyTorch.

`out[:, c, t] = silu(bias[c] + sum_k weight[c, k] * xpad[:, c, t + k])` where `xpad` is the input preceded
by the K-1 previous inputs (the cached window, zeros for a fresh sequence). Reference: causal-conv1d's
`causal_conv1d_fn` / `causal_conv1d_update`, transformers `NemotronHMamba2Mixer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a segment that continues `window`, followed by SiLU.

    Args:
        x: [b, c, T] new inputs.
        weight: [c, K] taps; bias: [c] or None.
        window: [b, c, K-1] the K-1 inputs before `x` (zeros for a fresh sequence).
    Returns:
        out [b, c, T] in x's dtype, and the padded input [b, c, K-1+T] (its last K-1 columns are the
        window that follows the segment; the mixer picks per-row windows from it when rows are padded).
    """
    xpad = torch.cat([window.to(x.dtype), x], dim=-1)
    out = F.conv1d(xpad, weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype), groups=x.shape[1])
    return F.silu(out), xpad


def causal_conv1d_update(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One decode step of the causal conv + SiLU, rolling `window` in place.

    Args:
        x: [b, c] the new input; window: [b, c, K-1] (updated in place); weight: [c, K]; bias: [c] or None.
    Returns:
        out [b, c] in x's dtype.
    """
    full = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)  # [b, c, K]
    out = (full * weight.to(full.dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(out.dtype)
    window.copy_(full[:, :, 1:])
    return F.silu(out).to(x.dtype)
