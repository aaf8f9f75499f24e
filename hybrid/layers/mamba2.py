"""The Mamba-2 mixer (`M` layers): in_proj, causal conv, selective SSD scan, gated grouped RMSNorm, out_proj.

Dao & Gu 2024, "Transformers are SSMs" (Mamba-2), section 7.1 and Listing 1; reference implementations:
mamba-ssm `Mamba2`, transformers `NemotronHMamba2Mixer`. Forward:

1. zxbcdt = in_proj(x), split as [z: d_inner | xBC: conv_dim | dt: nh]
2. xBC = silu(causal_conv1d(xBC)) continuing the cached conv window; split as [x: d_inner | B | C]
3. dt = clamp(softplus(dt + dt_bias), *time_step_limit); A = -exp(A_log); fp32
4. y = SSD(x, dt, A, B, C) + D * x with an fp32 state [nh, P, N] (chunked for several tokens, one
   recurrent step for a single token on a cache; on the CPU with a cache, steps 2-4 of several tokens run
   in the C++ prompt-chunk kernel, the recurrence token by token: `hybrid.ops.mamba_chunks_fused`)
5. out = out_proj(gated_grouped_rmsnorm(y, z))

The clamp uses `time_step_limit` only, on every path (tests/test_cases.py, case 1). Padded positions get dt = 0 (no
decay, no input) and are skipped by the conv window, so they leave the state untouched (cases 4 and 5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.cache import MambaState, StepContext
from hybrid.config import HybridConfig
from hybrid.layers.norm import GatedRMSNorm
from hybrid.ops import causal_conv1d, mamba_chunks_fused, mamba_decode_step, ssd_scan, ssd_step


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


class Mamba2Mixer(nn.Module):
    """Shapes: x [B, T, hidden_size] -> [B, T, hidden_size]; the state in `MambaState` is updated in place."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.ssm_state_size = config.ssm_state_size
        self.d_inner = config.d_inner
        self.conv_dim = config.conv_dim
        self.conv_kernel = config.conv_kernel
        self.chunk_size = config.chunk_size
        self.time_step_limit = tuple(config.time_step_limit)

        self.in_proj = nn.Linear(config.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=config.use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, config.conv_kernel, groups=self.conv_dim, bias=config.use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, self.n_groups, eps=config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=config.use_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None, state: MambaState | None = None) -> torch.Tensor:
        """`state`: this layer's handle from `Cache.layer` (for a packed forward, `state.seq(s)` gives sequence
        `s`'s `MambaState`, a view of its slot, and `state.rows(seqs)` the pools and the sequences' rows in
        them), or None without a cache."""
        b, T, _ = x.shape
        mask = ctx.mask if ctx is not None else None
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        if ctx is not None and ctx.packed is not None:  # the recurrences per sequence, each in its own slot
            y = self._mix_packed(xBC, dt, ctx.packed, state)
        elif state is not None and T == 1 and mask is None:  # decode: one step per row
            y = self._decode(xBC[:, 0], dt[:, 0], state.conv, state.ssm, torch.arange(b, device=x.device))[:, None]
        else:
            y = self._mix(xBC, dt, mask, state)
        y = self.norm(y.reshape(b, T, self.d_inner), z, out_dtype=x.dtype)
        return self.out_proj(y)

    def _decode(self, xBC, dt, conv, ssm, index) -> torch.Tensor:
        """One token of each of S sequences whose states are rows `index` of `conv` / `ssm` (in place):
        xBC [S, conv_dim], dt [S, nh] -> y [S, nh, p] fp32 with the D skip (`hybrid.ops.mamba_decode_step`)."""
        return mamba_decode_step(xBC, dt, conv, ssm, index, self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias,
                                 -torch.exp(self.A_log.float()), self.D, self.time_step_limit, self.d_inner,
                                 self.n_groups)

    def _fused_chunks(self, xBC, dt, conv, ssm, index, starts, lengths) -> torch.Tensor | None:
        """Prompt chunks of sequences whose states are rows `index` of `conv` / `ssm` (in place), packed in
        xBC [L, conv_dim], dt [L, nh] at rows starts[s] .. starts[s] + lengths[s] - 1, through one call of
        the C++ kernel -> y [L, nh, p] fp32 with the D skip; None where there is no kernel (the caller then
        runs the PyTorch prefill: `hybrid.ops.mamba_chunks_fused`)."""
        return mamba_chunks_fused(xBC, dt, conv, ssm, starts, lengths, index, self.conv1d.weight[:, 0],
                                  self.conv1d.bias, self.dt_bias, -torch.exp(self.A_log.float()), self.D,
                                  self.time_step_limit, self.d_inner, self.n_groups)

    def _mix_packed(self, xBC, dt, packed, state) -> torch.Tensor:
        """The recurrences of the packed sequences: the verifying ones token by token (`_verify`); every
        one-token sequence (a decode) in one `_decode` over its slot rows; the prompt chunks of all other sequences in one `_fused_chunks` call over their
        slot rows, or without that kernel grouped by length (`pad_groups`), each group as one right-padded
        batch (`_mix_chunks`), a chunk alone on a view of its slot."""
        if packed.decode_only:  # every sequence one token, in packed order: one call, no gathering
            conv, ssm, index = state.rows(range(len(packed.lengths)))
            return self._decode(xBC[0], dt[0], conv, ssm, index)[None]
        segments = list(packed.segments())
        verifying = [seg for seg in segments if seg[0] in packed.verifying]
        singles = [(s, s0) for s, s0, s1 in segments if s1 - s0 == 1 and s not in packed.verifying]
        chunks = [seg for seg in segments if seg[2] - seg[1] > 1 and seg[0] not in packed.verifying]
        ys = self._verify(xBC[0], dt[0], verifying, state) if verifying else {}
        if singles:
            conv, ssm, index = state.rows([s for s, _ in singles])
            at = torch.tensor([s0 for _, s0 in singles], device=xBC.device)
            y = self._decode(xBC[0, at], dt[0, at], conv, ssm, index)
            ys.update({s: y[j][None, None] for j, (s, _) in enumerate(singles)})
        if chunks:
            conv, ssm, index = state.rows([s for s, _, _ in chunks])
            starts = torch.tensor([s0 for _, s0, _ in chunks])
            lengths = torch.tensor([s1 - s0 for _, s0, s1 in chunks])
            y = self._fused_chunks(xBC[0], dt[0], conv, ssm, index, starts, lengths)
            if y is not None:
                ys.update({s: y[None, s0:s1] for s, s0, s1 in chunks})
                chunks = []
        for group in pad_groups(chunks):
            if len(group) == 1:
                s, s0, s1 = group[0]
                ys[s] = self._mix(xBC[:, s0:s1], dt[:, s0:s1], None, state.seq(s))
            else:
                ys.update(self._mix_chunks(xBC[0], dt[0], group, state))
        return torch.cat([ys[s] for s, _, _ in segments], dim=1)

    def _verify(self, xBC, dt, segments, state) -> dict[int, torch.Tensor]:
        """The verifying sequences `segments` [(sequence, start, end)] of the packed xBC [L, conv_dim], dt
        [L, nh] (each its last token and its drafts): one `_decode` per token position over all of them, and
        after each token but a sequence's last its states kept (`state.keep`) for the engine's rollback to
        the last accepted token. Only the small recurrences step token by token; the projections around
        them ran once over every token. Returns each sequence's y [1, n, nh, p] fp32."""
        parts: dict[int, list[torch.Tensor]] = {s: [] for s, _, _ in segments}
        for t in range(max(s1 - s0 for _, s0, s1 in segments)):
            active = [(s, s0) for s, s0, s1 in segments if s1 - s0 > t]
            conv, ssm, index = state.rows([s for s, _ in active])
            at = torch.tensor([s0 + t for _, s0 in active], device=xBC.device)
            y = self._decode(xBC[at], dt[at], conv, ssm, index)
            for j, (s, _) in enumerate(active):
                parts[s].append(y[j])
            more = [s for s, s0, s1 in segments if s1 - s0 > t + 1]
            if more:
                state.keep(t, more)
        return {s: torch.stack(p)[None] for s, p in parts.items()}

    def _mix_chunks(self, xBC, dt, group, state) -> dict[int, torch.Tensor]:
        """Several sequences' prompt chunks `group` [(sequence, start, end)] of the packed xBC [L, conv_dim],
        dt [L, nh] as one batch, right-padded to the longest (padded positions get dt = 0 and stay out of
        the conv window, so each state ends exactly as its chunk alone leaves it); their states are gathered
        from their slot rows and written back. Returns each sequence's y [1, n, nh, p] fp32."""
        lengths = torch.tensor([s1 - s0 for _, s0, s1 in group], device=xBC.device)
        starts = torch.tensor([s0 for _, s0, _ in group], device=xBC.device)
        steps = torch.arange(int(lengths.max()), device=xBC.device)
        mask = steps[None, :] < lengths[:, None]  # [S, T]
        at = torch.where(mask, starts[:, None] + steps[None, :], 0)
        conv, ssm, index = state.rows([s for s, _, _ in group])
        batch = MambaState(conv=conv.index_select(0, index), ssm=ssm.index_select(0, index))
        y = self._mix(xBC[at].masked_fill(~mask[..., None], 0.0), dt[at], mask, batch)
        conv.index_copy_(0, index, batch.conv)
        ssm.index_copy_(0, index, batch.ssm)
        return {s: y[j:j + 1, :s1 - s0] for j, (s, s0, s1) in enumerate(group)}

    def _mix(self, xBC: torch.Tensor, dt: torch.Tensor, mask: torch.Tensor | None, state: MambaState | None
             ) -> torch.Tensor:
        """Steps 2-4 of the module docstring: xBC [b, T, conv_dim], dt [b, T, nh] (raw) -> y [b, T, nh, p]
        fp32 with the D skip, continuing and updating `state`."""
        b, T, _ = xBC.shape
        if state is not None and mask is None and T > 1:  # a prefill continuing the cache's rows
            y = self._fused_chunks(xBC.reshape(b * T, -1), dt.reshape(b * T, -1), state.conv, state.ssm,
                                   torch.arange(b), torch.arange(b) * T, torch.full((b,), T))
            if y is not None:
                return y.view(b, T, self.num_heads, self.head_dim)
        xBC = self._conv(xBC, mask, state)
        xs, B, C = xBC.split([self.d_inner, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], dim=-1)

        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)  # [b, T, nh]
        if mask is not None:
            dt = dt * mask[..., None]
        A = -torch.exp(self.A_log.float())
        xs = xs.view(b, T, self.num_heads, self.head_dim)
        B = B.view(b, T, self.n_groups, self.ssm_state_size)
        C = C.view(b, T, self.n_groups, self.ssm_state_size)

        if state is not None and T == 1:
            y = ssd_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm)[:, None]
        else:
            y, final = ssd_scan(xs, dt, A, B, C, self.chunk_size, None if state is None else state.ssm)
            if state is not None:
                state.ssm.copy_(final)
        return y + self.D.float()[:, None] * xs.float()

    def _conv(self, xBC: torch.Tensor, mask: torch.Tensor | None, state: MambaState | None) -> torch.Tensor:
        """Causal conv + SiLU over [b, T, conv_dim], continuing and updating the cached window.

        With a padding mask, each row's real tokens are moved to the front (order kept) before the conv and
        moved back after it, so a real token's window holds the previous real tokens whatever padding lies
        between them; the new window is the K-1 inputs ending at the row's last real token.
        """
        b, T, c = xBC.shape
        K1 = self.conv_kernel - 1
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        window = state.conv if state is not None else xBC.new_zeros(b, c, K1)
        if mask is None:
            out, xpad = causal_conv1d(xBC.transpose(1, 2), weight, bias, window)
            new_window = xpad[:, :, xpad.shape[-1] - K1 :]
        else:
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
            gather_idx = order[:, None, :].expand(b, c, T)
            out_c, xpad = causal_conv1d(xBC.transpose(1, 2).gather(2, gather_idx), weight, bias, window)
            out = torch.empty_like(out_c).scatter_(2, gather_idx, out_c)
            n_real = mask.sum(dim=1)
            win_idx = n_real[:, None] + torch.arange(K1, device=xBC.device)[None, :]
            new_window = xpad.gather(2, win_idx[:, None, :].expand(b, c, K1))
        if state is not None:
            state.conv.copy_(new_window)
        return out.transpose(1, 2)
