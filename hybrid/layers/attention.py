"""Grouped-query attention with no positional encoding (`*` layers).

Nemotron-H attention applies no RoPE: `rope_theta` in published configs is a leftover and is ignored.
`q_proj [nq*hd, H]`, `k_proj`/`v_proj [nkv*hd, H]`, `o_proj [H, nq*hd]`, causal softmax attention with scale
`hd ** -0.5` (reference: transformers `NemotronHAttention`). The attention itself is an operation of
`hybrid.ops.attention`, which picks its kernel: a forward without a cache and each prompt chunk (or
verification) of a packed step over its sequence's keys through `causal_attention`, the step's decode tokens
over their rows of the paged pool in one `paged_decode_attention` call (the cache handle's `attend_decode`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.cache import StepContext
from hybrid.config import HybridConfig
from hybrid.ops import causal_attention


def attention_mask(ctx: StepContext, num_tokens: int, device) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, past+T] (True = attend) for causal attention over real keys, or None when
    plain causal attention from position `past` needs none.

    A query always sees itself, so a padding query (whose output is discarded) never gets an empty row.
    """
    past, T = ctx.past, num_tokens
    if ctx.key_mask is None and (past == 0 or T == 1):
        return None
    S = past + T
    query_pos = torch.arange(past, S, device=device)[:, None]
    key_pos = torch.arange(S, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]  # [1, 1, T, S]
    if ctx.key_mask is not None:
        allowed = allowed & ctx.key_mask[:, None, None, :]
        allowed = allowed | (key_pos == query_pos)[None, None]
    return allowed


class Attention(nn.Module):
    """Shapes: x [B, T, hidden_size] -> [B, T, hidden_size]; keys and values stored in the cache's blocks."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        H, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None, kv=None) -> torch.Tensor:
        """`kv`: this layer's handle from `Cache.layer` (for a packed forward, `kv.seq(s)` gives sequence
        `s`'s), or None without a cache."""
        b, T, _ = x.shape
        q = self.q_proj(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if ctx is None:
            ctx = StepContext(past=0, mask=None, key_mask=None)
        if ctx.packed is None:
            out = self._attend(q, k, v, ctx, kv)
        else:  # each packed sequence attends to its own keys only
            out = self._attend_packed(q, k, v, ctx, kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, self.num_heads * self.head_dim))

    def _attend_packed(self, q, k, v, ctx: StepContext, kv) -> torch.Tensor:
        """A packed forward's attention, [1, nq, T, hd]: the one-token (decode) sequences together in one
        `attend_decode` of the cache handle (their keys and values stored and their queries attended over
        their rows of the pool), the others each alone."""
        if ctx.packed.decode_only:  # every sequence one token, in packed order
            seqs = range(len(ctx.packed.lengths))
            got = kv.attend_decode(seqs, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
            return got.transpose(0, 1)[None].to(q.dtype)  # [1, nq, n, hd]
        segments = list(ctx.packed.segments())
        ones = ctx.packed.ones  # (sequence, row), the sequence's index in packed order
        outs: list[torch.Tensor | None] = [None] * len(segments)
        if ones:
            at = ctx.packed.index([s0 for _, s0 in ones])
            got = kv.attend_decode([s for s, _ in ones], q[0][:, at].transpose(0, 1),
                                   k[0][:, at].transpose(0, 1), v[0][:, at].transpose(0, 1))  # [n, nq, hd]
            for j, (s, _) in enumerate(ones):
                outs[s] = got[j][None, :, None].to(q.dtype)
        for i, (s, s0, s1) in enumerate(segments):
            if outs[i] is None:
                outs[i] = self._attend(q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], ctx.for_sequence(s), kv.seq(s))
        return torch.cat(outs, dim=2)

    def _attend(self, q, k, v, ctx: StepContext, kv) -> torch.Tensor:
        """Causal attention of q [b, nq, T, hd] over the cached keys and values plus k, v [b, nkv, T, hd]
        (stored into `kv` first) -> [b, nq, T, hd]."""
        if kv is not None:
            k, v = kv.update(k, v, ctx.past)
        return causal_attention(q, k, v, attention_mask(ctx, q.shape[2], q.device))
