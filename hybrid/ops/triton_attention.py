"""A Triton kernel of this project for attention's decode step on the GPU path: one query per sequence over its
rows of a paged KV pool, read where they lie (no gathered copy of a sequence's history).

`paged_decode_attention` launches one program per (sequence, KV head): the query heads of that KV head form one
[G, hd] tile (GQA: each key read once for all of them), the sequence's pool rows (found through its block table:
row = block * block_size + offset) stream through in tiles of `KEY_BLOCK` with an online softmax (running maximum and sum, FlashAttention's recurrence), and the output is
written once. fp32 inputs compute in fp32 throughout (IEEE products); bf16 / fp16 inputs multiply in their dtype
with fp32 sums, the probabilities rounded to the values' dtype for the second product, as FlashAttention does.
The specification is `hybrid.ops.attention.decode_attention` over each sequence's gathered rows (tested under
Triton's interpreter: tests/test_triton_ops.py).
"""

from __future__ import annotations

import torch

from moe.quant.kernels import backend

IMPORT_ERROR = ""  # why triton did not import
try:
    import triton
    import triton.language as tl
except ImportError as e:  # triton is optional (the `cuda` extra)
    triton, IMPORT_ERROR = None, f"{type(e).__name__}: {e}"

KEY_BLOCK = 32  # pool rows per tile of the online softmax


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, scale,
                      stride_qs, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_os, stride_oh, stride_ts,
                      block_size, G, HD, BG: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
        s = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, BG)
        d = tl.arange(0, BD)
        mq = (g < G)[:, None] & (d < HD)[None, :]
        heads = h * G + g
        q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=mq, other=0.0)
        table = tables_ptr + s.to(tl.int64) * stride_ts
        length = tl.load(lengths_ptr + s)
        m_i = tl.full([BG], float("-inf"), tl.float32)
        l_i = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BD], tl.float32)
        for j in range(0, length, BS):
            pos = j + tl.arange(0, BS)
            valid = pos < length
            block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
            rows = block * block_size + pos % block_size
            mk = valid[:, None] & (d < HD)[None, :]
            k = tl.load(k_ptr + rows[:, None] * stride_kr + h * stride_kh + d[None, :], mask=mk, other=0.0)
            v = tl.load(v_ptr + rows[:, None] * stride_vr + h * stride_vh + d[None, :], mask=mk, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + d[None, :], out, mask=mq)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table) -> torch.Tensor:
    """`hybrid.ops.paged_decode_attention` in one launch: q [n, nq, hd], k_pool / v_pool [P, nkv, hd] with the head
    dimension contiguous, `table` a `hybrid.ops.attention.PagedTable` (each sequence's block table and length, at
    least one position, on q's device) -> [n, nq, hd] fp32. No value goes to the host.

    Raises:
        ValueError: a sequence without positions, or query heads that are not a multiple of the KV heads.
    """
    n, nq, hd = q.shape
    nkv = k_pool.shape[1]
    if nq % nkv or min(table.host_lengths, default=1) < 1:
        raise ValueError(f"paged decode attention: {nq} query heads over {nkv} KV heads, sequence lengths "
                         f"{table.host_lengths}")
    q = q.contiguous()
    tables = table.block_tables
    out = torch.empty(n, nq, hd, dtype=torch.float32, device=q.device)
    G = nq // nkv
    with backend.launch_guard(q.device):
        _paged_decode[(n, nkv)](
            q, k_pool, v_pool, tables, table.lengths, out, hd ** -0.5,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            out.stride(0), out.stride(1), tables.stride(0), table.block_size, G, hd,
            BG=max(16, triton.next_power_of_2(G)), BS=KEY_BLOCK, BD=max(16, triton.next_power_of_2(hd)),
            IEEE=q.dtype == torch.float32)
    return out
