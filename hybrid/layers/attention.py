"""Grouped-query attention with no positional encoding (`*` layers).

Nemotron-H attention applies no RoPE: `rope_theta` in published configs is a leftover and is ignored.
`q_proj [nq*hd, H]`, `k_proj`/`v_proj [nkv*hd, H]`, `o_proj [H, nq*hd]`, causal softmax attention with scale
`hd ** -0.5` through `torch.nn.functional.scaled_dot_product_attention` (reference: transformers
`NemotronHAttention`); one query over unmasked keys on the CPU (a decode step) by `decode_attention`, the
specification of the C++ kernel that runs it when built (`hybrid.ops.cpu.attention_module`: the keys and
values read where they lie, a paged cache's pool rows included, never gathered into a copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.cache import KVCache, StepContext
from hybrid.config import HybridConfig
from moe.quant.kernels import backend

_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per row over all of its keys: q [b, nq, 1, hd], k / v [b, nkv, S, hd] -> [b, nq, 1, hd]
    (q's dtype), softmax(q k^T hd^-0.5) v in fp32 with the nq / nkv query heads of a KV head grouped into
    one matrix product (no repeated keys). Equal to `scaled_dot_product_attention` up to rounding (fp32
    sums). Why: on the CPU, PyTorch's SDPA of one bf16 query is many times slower than this grouped fp32
    product, and a many-sequence decode step of the medium preset spent much of its time there
    (docs/perf-log.md#decode-attention-grouped)."""
    b, nq, _, hd = q.shape
    nkv = k.shape[1]
    scores = q.reshape(b, nkv, nq // nkv, hd).float() @ k.float().transpose(-1, -2) * hd ** -0.5  # [b, nkv, g, S]
    out = scores.softmax(dim=-1) @ v.float()  # [b, nkv, g, hd]
    return out.reshape(b, nq, 1, hd).to(q.dtype)


def decode_kernel(q: torch.Tensor, k: torch.Tensor):
    """The CPU decode-attention extension for queries `q` over keys `k` (CPU, both fp32 or both bf16, the
    head dimension contiguous), or None: `decode_attention` then."""
    if not backend.cpu_kernels(q) or q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16) \
            or k.stride(-1) != 1:
        return None
    from hybrid.ops.cpu import attention_module

    return attention_module()


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`decode_attention` (shapes and result as there), through the C++ kernel when it is built: the same
    fp32 math with the sums in another order, reading k and v where they lie (no fp32 copies; a paged cache's
    rows without gathering them): faster than the gather and `decode_attention` in a many-sequence decode step
    (docs/perf-log.md#decode-attention-in-place)."""
    ext = decode_kernel(q, k)
    if ext is None or v.stride(-1) != 1 or v.stride() != k.stride():
        return decode_attention(q, k, v)
    b, nq, _, hd = q.shape
    return ext.decode_attention(q.reshape(b, nq, hd), k, v, hd ** -0.5).reshape(b, nq, 1, hd).to(q.dtype)


class Attention(nn.Module):
    """Shapes: x [B, T, hidden_size] -> [B, T, hidden_size]; keys and values appended to the `KVCache`."""

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

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None, kv: KVCache | None = None) -> torch.Tensor:
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
        """A packed forward's attention, [1, nq, T, hd]: the one-token (decode) sequences together through
        the kernel's paged entry when the cache offers it (`attend_decode`: one call over their pool rows),
        the others each alone."""
        ext = decode_kernel(q, k) if hasattr(kv, "attend_decode") else None
        if ext is not None and ctx.packed.decode_only:  # every sequence one token, in packed order
            seqs = range(len(ctx.packed.lengths))
            got = kv.attend_decode(seqs, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), ext)
            return got.transpose(0, 1)[None].to(q.dtype)  # [1, nq, n, hd]
        segments = list(ctx.packed.segments())
        ones = [i for i, (_, s0, s1) in enumerate(segments) if s1 - s0 == 1] if ext is not None else []
        outs: list[torch.Tensor | None] = [None] * len(segments)
        if ones:
            at = torch.tensor([segments[i][1] for i in ones], device=q.device)
            got = kv.attend_decode([segments[i][0] for i in ones], q[0][:, at].transpose(0, 1),
                                   k[0][:, at].transpose(0, 1), v[0][:, at].transpose(0, 1), ext)  # [n, nq, hd]
            for j, i in enumerate(ones):
                outs[i] = got[j][None, :, None].to(q.dtype)
        for i, (s, s0, s1) in enumerate(segments):
            if outs[i] is None:
                outs[i] = self._attend(q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], ctx.for_sequence(s), kv.seq(s))
        return torch.cat(outs, dim=2)

    def _attend(self, q, k, v, ctx: StepContext, kv) -> torch.Tensor:
        """Causal attention of q [b, nq, T, hd] over the cached keys and values plus k, v [b, nkv, T, hd]
        (stored into `kv` first) -> [b, nq, T, hd]."""
        T = q.shape[2]
        if kv is not None:
            k, v = kv.update(k, v, ctx.past)
        mask = attention_mask(ctx, T, q.device)
        if T == 1 and mask is None and backend.cpu_kernels(q):
            return one_query_attention(q, k, v)
        is_causal = mask is None and T > 1
        if self.num_kv_heads != self.num_heads and not _SDPA_HAS_GQA:  # torch 2.4
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        gqa = {"enable_gqa": True} if _SDPA_HAS_GQA and self.num_kv_heads != self.num_heads else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **gqa)
