"""The Mamba-2 state-space dual (SSD) scan in plain PyTorch: the readable reference.

Glossary (Mamba-2 paper, Dao & Gu 2024): b batch, l / s positions (target / source) inside a chunk, h heads,
g groups of B and C, r = h / g heads per group, p head dim, n state size. Head `h` reads group
`h // r` (contiguous groups; tests/test_cases.py, case 2).

Recurrence per head (state S [p, n], fp32):
    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t        y_t = S_t . C_t       (paper eq. 1-2)
The chunked form (paper section 6, Listing 1) computes a chunk of `l` positions at once: the intra-chunk
quadratic ("attention-like") term plus the contribution of the state entering the chunk, and the state
leaving it. `ssd_scan` streams chunk by chunk, carrying the state, so memory grows with chunk_size and
not with the sequence length. Every decay exponent is a sum of non-positive terms `dt * A`, formed as a
masked cumulative sum and clamped at 0, so no rounding can make `exp` overflow (tests/test_cases.py, case 7).

The `D * x` skip term is not included here; the mixer adds it.
"""

from __future__ import annotations

import torch


def _segsum(dA: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., i, j] = sum(dA[..., j+1 : i+1]) for j <= i, -inf above the diagonal.

    Shapes: dA [..., l] -> [..., l, l]. Computed as a cumulative sum of masked copies (never as a
    difference of two cumulative sums), so each entry is a sum of non-positive terms when dA <= 0.
    """
    l = dA.shape[-1]
    x = dA[..., None].expand(*dA.shape, l)  # x[..., i, j] = dA[..., i]
    below = torch.tril(torch.ones(l, l, dtype=torch.bool, device=dA.device), diagonal=-1)
    x = x.masked_fill(~below, 0.0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(l, l, dtype=torch.bool, device=dA.device))
    return out.masked_fill(~keep, -torch.inf)


def ssd_chunk(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the SSD scan.

    Args:
        x: [b, l, h, p] fp32 inputs.
        dt: [b, l, h] fp32 step sizes (after softplus, clamp and padding mask).
        A: [h] fp32, negative.
        B, C: [b, l, g, n] fp32.
        state: [b, h, p, n] fp32, the state before the chunk.
    Returns:
        y [b, l, h, p] fp32 (without the D skip) and the state after the chunk [b, h, p, n].
    """
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    dA = (dt * A).transpose(1, 2)  # [b, h, l], all <= 0
    seg = _segsum(dA).clamp(max=0.0)  # [b, h, l, s]
    decay_in = torch.cumsum(dA, dim=-1).clamp(max=0.0)  # [b, h, l]: from the chunk start to l (inclusive)
    xdt = (x * dt[..., None]).view(b, l, g, r, p)

    # intra-chunk: y_l = sum_{s <= l} (C_l . B_s) exp(sum dA over (s, l]) dt_s x_s
    CB = torch.einsum("blgn,bsgn->bgls", C, B)
    M = CB[:, :, None] * torch.exp(seg).view(b, g, r, l, l)
    y = torch.einsum("bgrls,bsgrp->blgrp", M, xdt)

    # the state entering the chunk, decayed to each position: y_l += exp(sum dA over [0, l]) C_l . S
    S = state.view(b, g, r, p, n)
    y = y + torch.einsum("blgn,bgrpn->blgrp", C, S) * torch.exp(decay_in).view(b, g, r, l).permute(0, 3, 1, 2)[..., None]

    # the state leaving the chunk
    decay_out = torch.exp(seg[..., -1, :]).view(b, g, r, l)  # from each source s to the chunk end
    new_state = S * torch.exp(decay_in[..., -1]).view(b, g, r, 1, 1) + torch.einsum(
        "bsgn,bsgrp->bgrpn", B, xdt * decay_out.permute(0, 3, 1, 2)[..., None]
    )
    return y.reshape(b, l, h, p), new_state.reshape(b, h, p, n)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan over a whole segment, streaming chunk by chunk.

    Args:
        x: [b, T, h, p]; dt: [b, T, h]; A: [h]; B, C: [b, T, g, n] (any float dtype; computed in fp32).
        chunk_size: positions per chunk.
        state: [b, h, p, n] initial state, or None for zeros.
    Returns:
        y [b, T, h, p] fp32 (without the D skip) and the final state [b, h, p, n] fp32.
    """
    b, T, h, p = x.shape
    n = B.shape[-1]
    state = x.new_zeros(b, h, p, n, dtype=torch.float32) if state is None else state.float()
    x, dt, A, B, C = x.float(), dt.float(), A.float(), B.float(), C.float()
    ys = []
    with torch.autocast(x.device.type, enabled=False):  # the scan is fp32 even inside a bf16 autocast region
        for start in range(0, T, chunk_size):
            end = min(start + chunk_size, T)
            y, state = ssd_chunk(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], state)
            ys.append(y)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(b, 0, h, p)
    return y, state


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One recurrent step, updating `state` in place (O(1) in the sequence length).

    Args:
        x: [b, h, p]; dt: [b, h]; A: [h]; B, C: [b, g, n]; state: [b, h, p, n] (fp32, written in place).
    Returns:
        y [b, h, p] fp32 (without the D skip).
    """
    b, h, p = x.shape
    g, n = B.shape[1:]
    dt = dt.float()
    decay = torch.exp(dt * A.float())  # [b, h]
    # heads viewed as [g, h/g]: head i reads group i // (h/g), by broadcasting B and C over a group's heads
    S = state.view(b, g, h // g, p, n)
    B = B.float().view(b, g, 1, 1, n)
    # state = decay * state + (dt * x) outer B, in place: the state is the largest tensor a decode step
    # touches (1 MB per layer and sequence at 32 heads x 64 x 128), so it is read and written twice, no temporaries
    S.mul_(decay.view(b, g, h // g, 1, 1)).addcmul_((x.float() * dt[..., None]).view(b, g, h // g, p, 1), B)
    # y = state C by vecdot: a batched matmul is slower here (docs/perf-log.md#ssd-decode-vecdot)
    y = torch.linalg.vecdot(S, C.float().view(b, g, 1, 1, n))
    return y.view(b, h, p)
