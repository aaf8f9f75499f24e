"""Attention's operations and the seam that picks their kernel (the attention layer calls only these).

- `decode_attention` is the specification of a decode step: one query per row over all of its keys, fp32
  softmax, the query heads of a KV head grouped into one matrix product (no repeated keys).
- `causal_attention`: the layer's attention without a cache or for a prompt chunk: one query with no mask on the
  CPU through the C++ kernel (`one_query_attention`), everything else through
  `torch.nn.functional.scaled_dot_product_attention`.
- `paged_decode_attention`: one query per sequence over its rows of a paged KV pool (the serving engine's decode
  tokens): on the CPU the kernel's paged entry and on the GPU path the Triton kernel (`triton_attention.py`) read
  the rows where they lie (no gathered copy); elsewhere each sequence's rows are gathered and go through
  `decode_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.quant.kernels import backend

_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


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
    fp32 math with the sums in another order, reading k and v where they lie (no fp32 copies): faster than
    `decode_attention` in a many-sequence decode step (docs/perf-log.md#decode-attention-in-place)."""
    ext = decode_kernel(q, k)
    if ext is None or v.stride(-1) != 1 or v.stride() != k.stride():
        return decode_attention(q, k, v)
    b, nq, _, hd = q.shape
    return ext.decode_attention(q.reshape(b, nq, hd), k, v, hd ** -0.5).reshape(b, nq, 1, hd).to(q.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [b, nq, T, hd] over k, v [b, nkv, S, hd] (the last T keys are the queries' own positions) -> [b, nq, T,
    hd]: `mask` [b or 1, 1, T, S] (True = attend), or None for plain causal attention (and for one query: all
    keys). One query without a mask takes `one_query_attention` where the CPU kernels run."""
    T, nq, nkv = q.shape[2], q.shape[1], k.shape[1]
    if T == 1 and mask is None and backend.cpu_kernels(q):
        return one_query_attention(q, k, v)
    if nkv != nq and not _SDPA_HAS_GQA:  # torch 2.4
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    gqa = {"enable_gqa": True} if _SDPA_HAS_GQA and nkv != nq else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, **gqa)


def triton_attention_module():
    """`hybrid.ops.triton_attention` (imported on the first call: CPU runs never import triton)."""
    from hybrid.ops import triton_attention

    return triton_attention


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           rows: list[torch.Tensor], table: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """One query per sequence over its rows of a paged pool: q [n, nq, hd], k_pool / v_pool [P, nkv, hd] (the
    pool's blocks flattened), rows[i] the pool rows of sequence i's positions in order (int64) -> [n, nq, hd]
    fp32. `table`: the same rows as (all of them concatenated, each sequence's start in that, its length), int64
    on q's device, when the caller made them before the layers (the Triton kernel's form; made from `rows` when
    not given). The CPU kernel's paged entry reads the rows in place, and on the GPU path this project's Triton
    kernel (`triton_attention.py`, one launch); elsewhere the rows are gathered per sequence (the specification)."""
    ext = decode_kernel(q, k_pool)
    if ext is not None:
        return ext.paged_decode_attention(q, k_pool, v_pool, rows, q.shape[-1] ** -0.5)
    if (kernels := backend.triton_kernels(q, triton_attention_module)) is not None and q.dtype == k_pool.dtype == \
            v_pool.dtype and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1:
        return kernels.paged_decode_attention(q, k_pool, v_pool, rows, table)
    outs = [decode_attention(q[i:i + 1, :, None].float(), k_pool[r].transpose(0, 1)[None],
                             v_pool[r].transpose(0, 1)[None]) for i, r in enumerate(rows)]
    return torch.cat(outs)[:, :, 0]
