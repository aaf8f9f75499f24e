"""One decode token of several sequences' Mamba-2 recurrences, each state a row of a pool, updated in place.

The plain PyTorch specification of `hybrid.ops.mamba_decode_step` (the C++ kernel `cpu_mamba.cpp` is
tested against it): for each sequence, the conv step and the SSD step of `conv1d.py` / `ssd.py` run on
views of its rows, so no state is ever gathered into a batch and scattered back. Rows `0..R-1` in order
(a `BatchCache`'s rows) run as one batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba_decode_step(xBC, dt, conv, ssm, index, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int,
                      n_groups: int, conv_step, ssd_step) -> torch.Tensor:
    """See `hybrid.ops.mamba_decode_step`; `conv_step` / `ssd_step` are the seam's own (kernels on CUDA)."""
    S = xBC.shape[0]
    if index.tolist() == list(range(conv.shape[0])):
        return _step(xBC, dt, conv, ssm, weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups,
                     conv_step, ssd_step)
    return torch.cat([_step(xBC[s:s + 1], dt[s:s + 1], conv[i:i + 1], ssm[i:i + 1], weight, bias, dt_bias, A, D,
                            time_step_limit, d_inner, n_groups, conv_step, ssd_step)
                      for s, i in zip(range(S), index.tolist())])


def _step(xBC, dt, conv, ssm, weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups, conv_step, ssd_step):
    b = xBC.shape[0]
    nh, p, n = ssm.shape[1:]
    out = conv_step(xBC, conv, weight, bias)
    x, B, C = out.split([d_inner, n_groups * n, n_groups * n], dim=-1)
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*time_step_limit)
    x = x.view(b, nh, p)
    y = ssd_step(x, dt, A, B.view(b, n_groups, n), C.view(b, n_groups, n), ssm)
    return y + D.float()[:, None] * x.float()
