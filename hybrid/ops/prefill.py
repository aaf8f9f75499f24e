"""Several tokens of the Mamba-2 recurrences in plain PyTorch: the specification of `hybrid.ops.mamba_chunks` (the
C++ prompt-chunk kernel is tested against it) and the forward without a cache (`mamba_scan`).

Steps 2-4 of the mixer (`hybrid.layers.mamba2`): the causal conv + SiLU continuing the conv window, dt =
clamp(softplus(dt + dt_bias), *time_step_limit), the chunked SSD scan continuing the SSM state, + D x. Padded
positions (False in `mask`) get dt = 0 (no decay, no input) and stay out of the conv window, so a row's state ends
exactly as its real tokens alone leave it (tests/test_cases.py, cases 4 and 5). `causal_conv1d` and `ssd_scan`
are the seam's own (mamba-ssm's scan on the GPU path), passed in as `hybrid.ops.decode` takes its steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba_scan(xBC, dt, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int, n_groups: int, chunk_size: int,
               causal_conv1d, ssd_scan, mask=None, conv=None, ssm=None) -> torch.Tensor:
    """xBC [b, T, conv_dim] (the in_proj output's conv part), dt [b, T, nh] (raw) -> y [b, T, nh, P] fp32 with
    the D skip. `conv` [b, conv_dim, K-1] / `ssm` [b, nh, P, N]: the states to continue, updated in place (None:
    from zero, nothing kept); `mask` [b, T] bool: real tokens (None: all). The other arguments as in
    `hybrid.ops.mamba_decode_step`."""
    b, T, _ = xBC.shape
    nh = A.shape[0]
    n = (xBC.shape[-1] - d_inner) // (2 * n_groups)
    xBC = _conv(xBC, weight, bias, mask, conv, causal_conv1d)
    xs, B, C = xBC.split([d_inner, n_groups * n, n_groups * n], dim=-1)
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*time_step_limit)  # [b, T, nh]
    if mask is not None:
        dt = dt * mask[..., None]
    xs = xs.view(b, T, nh, d_inner // nh)
    y, final = ssd_scan(xs, dt, A, B.view(b, T, n_groups, n), C.view(b, T, n_groups, n), chunk_size, ssm)
    if ssm is not None:
        ssm.copy_(final)
    return y + D.float()[:, None] * xs.float()


def _conv(xBC, weight, bias, mask, window, causal_conv1d) -> torch.Tensor:
    """Causal conv + SiLU over [b, T, conv_dim], continuing and updating `window` (None: zeros, not kept).

    With a padding mask, each row's real tokens are moved to the front (order kept) before the conv and moved
    back after it, so a real token's window holds the previous real tokens whatever padding lies between them;
    the new window is the K-1 inputs ending at the row's last real token.
    """
    b, T, c = xBC.shape
    K1 = weight.shape[-1] - 1
    start = window if window is not None else xBC.new_zeros(b, c, K1)
    if mask is None:
        out, xpad = causal_conv1d(xBC.transpose(1, 2), weight, bias, start)
        new_window = xpad[:, :, xpad.shape[-1] - K1:]
    else:
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
        gather_idx = order[:, None, :].expand(b, c, T)
        out_c, xpad = causal_conv1d(xBC.transpose(1, 2).gather(2, gather_idx), weight, bias, start)
        out = torch.empty_like(out_c).scatter_(2, gather_idx, out_c)
        win_idx = mask.sum(dim=1)[:, None] + torch.arange(K1, device=xBC.device)[None, :]
        new_window = xpad.gather(2, win_idx[:, None, :].expand(b, c, K1))
    if window is not None:
        window.copy_(new_window)
    return out.transpose(1, 2)


def pad_groups(segments: list[tuple[int, int, int]], max_padding: float = 2.0) -> list[list[tuple[int, int, int]]]:
    """Groups of packed segments (sequence, start, end) to run as right-padded batches: sorted by length,
    a segment joins the group of the ones just shorter while the group's padded size (count x longest)
    stays within `max_padding` x its real tokens. A group of one runs alone."""
    groups: list[list[tuple[int, int, int]]] = []
    real = 0
    for seg in sorted(segments, key=lambda seg: seg[2] - seg[1]):
        n = seg[2] - seg[1]
        if groups and (len(groups[-1]) + 1) * n <= max_padding * (real + n):
            groups[-1].append(seg)
            real += n
        else:
            groups.append([seg])
            real = n
    return groups


def mamba_chunks(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D, time_step_limit,
                 d_inner: int, n_groups: int, chunk_size: int, causal_conv1d, ssd_scan) -> torch.Tensor:
    """See `hybrid.ops.mamba_chunks`. The chunks grouped by length (`pad_groups`), each group one right-padded
    batch through `mamba_scan` over its states gathered from their rows and written back (a group of one on
    views of its rows)."""
    y = torch.zeros(xBC.shape[0], A.shape[0], d_inner // A.shape[0], dtype=torch.float32, device=xBC.device)
    segments = [(i, s0, s0 + n) for i, (s0, n) in enumerate(zip(starts.tolist(), lengths.tolist()))]
    rows = index.tolist()
    for group in pad_groups(segments):
        args = (weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups, chunk_size, causal_conv1d, ssd_scan)
        if len(group) == 1:
            (i, s0, s1), r = group[0], rows[group[0][0]]
            y[s0:s1] = mamba_scan(xBC[None, s0:s1], dt[None, s0:s1], *args, conv=conv[r:r + 1], ssm=ssm[r:r + 1])[0]
            continue
        n = torch.tensor([s1 - s0 for _, s0, s1 in group], device=xBC.device)
        first = torch.tensor([s0 for _, s0, _ in group], device=xBC.device)
        steps = torch.arange(int(n.max()), device=xBC.device)
        mask = steps[None, :] < n[:, None]  # [S, T]
        at = torch.where(mask, first[:, None] + steps[None, :], 0)
        own = torch.tensor([rows[i] for i, _, _ in group], device=conv.device)
        g_conv, g_ssm = conv.index_select(0, own), ssm.index_select(0, own)
        out = mamba_scan(xBC[at].masked_fill(~mask[..., None], 0.0), dt[at], *args, mask=mask, conv=g_conv, ssm=g_ssm)
        conv.index_copy_(0, own, g_conv)
        ssm.index_copy_(0, own, g_ssm)
        for j, (_, s0, s1) in enumerate(group):
            y[s0:s1] = out[j, :s1 - s0]
    return y
