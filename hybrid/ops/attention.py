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

import functools

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


class PagedTable:
    """Where n sequences' positions lie in a paged pool: `block_tables` [n, W] int64 on the pool's device (sequence
    i's blocks in order; entries past its last block unused), `lengths` [n] int64 its positions there, the same as
    host ints `host_lengths`, and `block_size`: position p of sequence i is pool row
    block_tables[i, p // block_size] * block_size + p % block_size (the form the GPU kernel reads; static in shape
    for a CUDA graph). `rows` gives each sequence's rows as one list (the CPU kernel's form)."""

    def __init__(self, block_tables: torch.Tensor, lengths: torch.Tensor, host_lengths: list[int], block_size: int):
        self.block_tables, self.lengths, self.host_lengths, self.block_size = (block_tables, lengths, host_lengths,
                                                                               block_size)

    @classmethod
    def of_rows(cls, rows: list[torch.Tensor]) -> "PagedTable":
        """The table of per-sequence row lists (blocks of one row; a host-to-device copy of the lengths)."""
        host = [int(r.shape[0]) for r in rows]  # shapes: host metadata, no device read
        device = rows[0].device if rows else torch.device("cpu")
        tables = torch.nn.utils.rnn.pad_sequence([r.to(torch.int64) for r in rows], batch_first=True) if rows else \
            torch.zeros(0, 0, dtype=torch.int64, device=device)
        return cls(tables, torch.tensor(host, dtype=torch.int64).to(device), host, 1)

    @functools.cached_property
    def rows(self) -> list[torch.Tensor]:
        """Each sequence's pool rows in order, [lengths[i]] int64 each (device operations only)."""
        bs = self.block_size
        offsets = torch.arange(bs, device=self.block_tables.device)
        return [(self.block_tables[i, :-(-n // bs)][:, None] * bs + offsets).flatten()[:n]
                for i, n in enumerate(self.host_lengths)]


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           rows: list[torch.Tensor] | PagedTable) -> torch.Tensor:
    """One query per sequence over its positions in a paged pool: q [n, nq, hd], k_pool / v_pool [P, nkv, hd] (the
    pool's blocks flattened), `rows` a `PagedTable` (the engine's: block tables made before the layers) or rows[i]
    the pool rows of sequence i's positions in order (int64) -> [n, nq, hd] fp32. The CPU kernel's paged entry
    reads the rows in place, and on the GPU path this project's Triton kernel (`triton_attention.py`, one launch,
    over the block tables); elsewhere the rows are gathered per sequence (the specification)."""
    ext = decode_kernel(q, k_pool)
    if ext is not None:
        listed = rows.rows if isinstance(rows, PagedTable) else rows
        return ext.paged_decode_attention(q, k_pool, v_pool, listed, q.shape[-1] ** -0.5)
    if (kernels := backend.triton_kernels(q, triton_attention_module)) is not None and q.dtype == k_pool.dtype == \
            v_pool.dtype and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1:
        return kernels.paged_decode_attention(q, k_pool, v_pool,
                                              rows if isinstance(rows, PagedTable) else PagedTable.of_rows(rows))
    listed = rows.rows if isinstance(rows, PagedTable) else rows
    outs = [decode_attention(q[i:i + 1, :, None].float(), k_pool[r].transpose(0, 1)[None],
                             v_pool[r].transpose(0, 1)[None]) for i, r in enumerate(listed)]
    return torch.cat(outs)[:, :, 0]
