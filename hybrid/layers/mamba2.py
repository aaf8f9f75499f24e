"""The Mamba-2 mixer (`M` layers): in_proj, causal conv, selective SSD scan, gated grouped RMSNorm, out_proj.

Dao & Gu 2024, "Transformers are SSMs" (Mamba-2), section 7.1 and Listing 1; reference implementations:
mamba-ssm `Mamba2`, transformers `NemotronHMamba2Mixer`. Forward:

1. zxbcdt = in_proj(x), split as [z: d_inner | xBC: conv_dim | dt: nh]
2. xBC = silu(causal_conv1d(xBC)) continuing the cached conv window; split as [x: d_inner | B | C]
3. dt = clamp(softplus(dt + dt_bias), *time_step_limit); A = -exp(A_log); fp32
4. y = SSD(x, dt, A, B, C) + D * x with an fp32 state [nh, P, N]
5. out = out_proj(gated_grouped_rmsnorm(y, z))

Steps 2-4 are one operation of `hybrid.ops` per phase, which picks its kernel beside its PyTorch specification:
without a cache `mamba_scan` (every row from the zero state, padding masked); on a cache (a packed step, each
sequence's state in its slot) the decode tokens in one `mamba_decode_step`, the prompt chunks in one
`mamba_chunks`, and the tokens verifying drafts one position at a time (`_verify`), their states kept.

The clamp uses `time_step_limit` only, on every path (tests/test_cases.py, case 1). Padded positions get dt = 0 (no
decay, no input) and are skipped by the conv window, so they leave the state untouched (cases 4 and 5).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.cache import PackedSeqs, StepContext
from hybrid.config import HybridConfig
from hybrid.layers.norm import GatedRMSNorm
from hybrid.ops import mamba_chunks, mamba_decode_step, mamba_scan


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

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None, state=None) -> torch.Tensor:
        """`state`: this layer's handle from `Cache.layer` (for a packed step: `state.rows(seqs)` gives the pools
        and the sequences' slots in them, `state.keep` keeps verifying sequences' states), or None without a
        cache."""
        b, T, _ = x.shape
        mask = ctx.mask if ctx is not None else None
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        if ctx is not None and ctx.packed is not None:  # the recurrences per sequence, each in its own slot
            y = self._mix_packed(xBC[0], dt[0], ctx.packed, state)[None]
        else:  # no cache: every row from the zero state (padding masked)
            y = mamba_scan(xBC, dt, *self._params(), self.chunk_size, mask=mask)
        y = self.norm(y.reshape(b, T, self.d_inner), z, out_dtype=x.dtype)
        return self.out_proj(y)

    def _params(self) -> tuple:
        """The arguments of the `hybrid.ops` Mamba operations after the states: conv taps [conv_dim, K] and bias,
        dt_bias, A = -exp(A_log) (fp32), D, time_step_limit, d_inner, n_groups."""
        return (self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, -torch.exp(self.A_log.float()), self.D,
                self.time_step_limit, self.d_inner, self.n_groups)

    def _mix_packed(self, xBC: torch.Tensor, dt: torch.Tensor, packed: PackedSeqs, state) -> torch.Tensor:
        """Steps 2-4 for the packed sequences, xBC [L, conv_dim], dt [L, nh] -> y [L, nh, P] fp32: the one-token
        sequences (decodes) in one `mamba_decode_step` over their slots, the prompt chunks in one `mamba_chunks`,
        the verifying sequences token by token (`_verify`)."""
        params = self._params()
        if packed.decode_only:  # every sequence one token, in packed order: one call, no gathering
            return mamba_decode_step(xBC, dt, *state.rows(range(len(packed.lengths))), *params)
        singles, chunks = packed.singles, packed.chunks
        if chunks:
            conv, ssm, index = state.rows([s for s, _, _ in chunks])
            y = mamba_chunks(xBC, dt, conv, ssm, packed.index([s0 for _, s0, _ in chunks]),
                             packed.index([s1 - s0 for _, s0, s1 in chunks]), index, *params, self.chunk_size,
                             max_length=max(s1 - s0 for _, s0, s1 in chunks))
        else:
            y = torch.zeros(xBC.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=xBC.device)
        if singles:
            at = packed.index([s0 for _, s0 in singles])
            y[at] = mamba_decode_step(xBC[at], dt[at], *state.rows([s for s, _ in singles]), *params)
        verifying = [seg for seg in packed.segments() if seg[0] in packed.verifying]
        if verifying:
            self._verify(xBC, dt, verifying, state, y)
        return y

    def _verify(self, xBC, dt, segments, state, y: torch.Tensor) -> None:
        """The verifying sequences `segments` [(sequence, start, end)] of the packed xBC [L, conv_dim], dt [L, nh]
        (each its last token and its drafts), written into y [L, nh, P]: one `mamba_decode_step` per token
        position over all of them, and after each token but a sequence's last its states kept (`state.keep`) for
        the engine's rollback to the last accepted token. Only the small recurrences step token by token; the
        projections around them ran once over every token."""
        params = self._params()
        for t in range(max(s1 - s0 for _, s0, s1 in segments)):
            active = [(s, s0) for s, s0, s1 in segments if s1 - s0 > t]
            at = torch.tensor([s0 + t for _, s0 in active], device=xBC.device)
            y[at] = mamba_decode_step(xBC[at], dt[at], *state.rows([s for s, _ in active]), *params)
            more = [s for s, s0, s1 in segments if s1 - s0 > t + 1]
            if more:
                state.keep(t, more)
