"""The routed experts as operations, each choosing its kernel beside its reference (`dispatch`).

    dispatch          the reference: the (token, expert) pairs sorted by expert and gathered once, each chosen
                      expert run over its contiguous slice of tokens, the weighted outputs summed per token in
                      fp32; experts nobody chose are never touched
    packed_experts    experts with packed weights (`moe.quant.PackedWeight` stacks): the fused Triton kernels on
                      the GPU path (`triton.py`, both projections of all chosen experts in two launches), the CPU
                      extension straight from the packed bytes (`cpu.py`, all chosen experts in one call per
                      projection), else `dispatch` over `expert_linear`'s per-expert products
    expert_linear     one expert's product from a packed stack: the CPU extension, else the dequantized weight
    dense_experts     experts with dense float stacks: the grouped Triton kernels on the GPU path (no host round
                      trip), else `dispatch`

Experts are non-gated squared-ReLU MLPs, `y = down(relu2(up(x)))` (`relu2` here: the activation every expert
kernel applies). The bf16 experts prepacked for the CPU run in `prepacked.py` on `dispatch` and `bf16.py`.
"""

from __future__ import annotations

from typing import Callable

import torch

from moe.quant import kernels
from moe.quant.packed import PackedWeight


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, `relu(x) ** 2` (So et al. 2021, Primer): the activation of every Nemotron-H MLP."""
    return torch.relu(x).square()


def cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `ts` (one width) as one tensor: the only one itself, or their concatenation."""
    return ts[0] if len(ts) == 1 else torch.cat(ts)


# ------------------------------------------------------------------------------------------ the reference
def sort_by_expert(ids: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] in [0, bins) -> (order of the flattened pairs sorted by expert (stable), the token of each
    sorted pair, pairs per bin [bins]); counted by a scatter of fixed size (`bincount` would read the largest id
    back to the host)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // ids.shape[1], torch.zeros(bins, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor, T: int,
            dtype: torch.dtype, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs of the sorted pairs [T*k, L] -> their weighted sum per token [T, L], summed in fp32.
    `valid` [T*k] bool: the sorted pairs to sum (the others' rows may hold anything, NaN included)."""
    y = y.float() * weights.reshape(-1)[order, None]
    if valid is not None:
        y = torch.where(valid[:, None], y, 0.0)
    return torch.zeros(T, y.shape[-1], dtype=torch.float32, device=y.device).index_add_(0, token_of, y).to(dtype)


def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int,
             expert: Callable[[int, torch.Tensor], torch.Tensor],
             group: Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Run `expert(e, x_e)` for every expert e that some token chose, and combine: x [T, L], weights [T, k]
    fp32, ids [T, k] -> [T, L] in x's dtype.

    Each chosen expert gets its contiguous slice `x_e` [n_e, L] of the tokens sorted by expert; a single
    token (decode at batch 1) skips the sort. With `group(experts, xs)` (a bank's kernel taking several
    experts in one call, equal to `[expert(e, x_e) for e, x_e in zip(experts, xs)]`) all the chosen experts
    run in one call: one fork of the threads, balanced over every expert's tiles, instead of one per expert
    (a decode step of 16 sequences chooses most of the experts of every layer, with 1-4 rows each).
    Pairs whose id lies outside [0, n_experts) (experts another rank holds, `hybrid.parallel`) are skipped:
    they add nothing to the sum.
    """
    T = ids.shape[0]
    if T == 1:  # the checks in Python on k ints: a decode step's fixed cost is its count of tensor calls
        chosen = ids[0].tolist()
        if not all(0 <= e < n_experts for e in chosen):
            keep = [j for j, e in enumerate(chosen) if 0 <= e < n_experts]
            if not keep:
                return x.new_zeros(1, x.shape[-1])
            ids, weights, chosen = ids[:, keep], weights[:, keep], [chosen[j] for j in keep]
        if group is not None:
            y = torch.stack(group(chosen, [x] * len(chosen)))  # [k, 1, L]
            return (y.float() * weights.reshape(-1, 1, 1)).sum(0).to(x.dtype)  # summed in fp32
        y = torch.zeros(1, x.shape[-1], dtype=torch.float32, device=x.device)
        for e, w in zip(chosen, weights[0].tolist()):
            y.add_(expert(e, x).float(), alpha=w)
        return y.to(x.dtype)
    inside = (ids >= 0) & (ids < n_experts)
    if not bool(inside.all()):
        ids = ids.masked_fill(~inside, n_experts)  # sorted last, never run
    order, token_of, counts = sort_by_expert(ids, n_experts + 1)  # the last bin: the pairs skipped
    counts = counts.tolist()[:n_experts]
    m = sum(counts)
    if m == 0:
        return x.new_zeros(T, x.shape[-1])
    order, token_of = order[:m], token_of[:m]
    parts = torch.split(x[token_of], counts)
    chosen = [e for e in range(n_experts) if counts[e]]
    ys = group(chosen, [parts[e] for e in chosen]) if group is not None else [expert(e, parts[e]) for e in chosen]
    return combine(cat(ys), weights, order, token_of, T, x.dtype)


# ------------------------------------------------------------------------------------------ packed experts
def expert_linear(x: torch.Tensor, proj, e: int) -> torch.Tensor:
    """x [R, in] @ W_e.T -> [R, out] in x's dtype, for expert `e` of `proj`: a packed stack (the CPU extension
    straight from its bytes where it applies, else expert e's weight dequantized for the call) or a dense stack
    (anything with `dequantize(dtype, expert=e)`)."""
    if isinstance(proj, PackedWeight) and (cpu := kernels.cpu_for(x, proj.fmt)) is not None:
        return cpu.linear(x, proj, expert=e).to(x.dtype)
    return x @ proj.dequantize(x.dtype, expert=e).T


def packed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, up, down, n_experts: int
                   ) -> torch.Tensor:
    """The routed experts over x [T, L] with weights [T, k] fp32 and ids [T, k] -> [T, L] in x's dtype, for the
    `n_experts` stacks `up` [E, I, L] and `down` [E, L, I] (each a `PackedWeight` stack, or a dense stack where a format
    is None). Kernels: both packed in formats the fused Triton kernels support, on the GPU path: `fused_experts`;
    both packed in formats the CPU extension supports, on a CPU: all chosen experts in one call per
    projection; otherwise `dispatch` over `expert_linear`. Memory: at most one expert's dequantized weights at
    a time on the reference path, none on the kernels'.

    Raises:
        KernelUnavailable: the GPU path without triton under HYBRID_REQUIRE_CUDA_KERNELS=1.
    """
    both = isinstance(up, PackedWeight) and isinstance(down, PackedWeight)
    if both and kernels.triton_for(x, up.fmt, down.fmt) is not None:
        return fused_experts(x, weights, ids, up, down)
    group = None
    if both and kernels.cpu_for(x, up.fmt) is not None and kernels.cpu_for(x, down.fmt) is not None:
        group = lambda chosen, xs: _cpu_group(chosen, xs, up, down)  # noqa: E731
    return dispatch(x, weights, ids, n_experts,
                    lambda e, part: expert_linear(relu2(expert_linear(part, up, e)), down, e), group)


def _cpu_group(chosen: list[int], xs: list[torch.Tensor], up, down) -> list[torch.Tensor]:
    """Experts `chosen` over their inputs `xs` on the CPU extension: their up projections in one call, then
    their down projections in another; each elementwise step done once over all the experts' rows (a decode
    step's fixed cost is its call count)."""
    from moe.quant.kernels import cpu

    sizes, dtype = [x.shape[0] for x in xs], xs[0].dtype
    h = relu2(cat(cpu.linear_group(xs, up, chosen)).to(dtype))
    y = cat(cpu.linear_group(list(cpu.kernel_input(h).split(sizes)), down, chosen)).to(dtype)
    return list(y.split(sizes))


def dense_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, down: torch.Tensor
                  ) -> torch.Tensor:
    """The routed experts over x [T, L] with weights [T, k] fp32 and ids [T, k] -> [T, L] in x's dtype, for dense
    float stacks `up` [E, I, L] and `down` [E, L, I]: on the GPU path both projections of all chosen experts in
    two grouped Triton launches without a host round trip (`fused_experts`), else `dispatch` over each chosen
    expert's two products (the reference).

    Raises:
        KernelUnavailable: the GPU path without triton under HYBRID_REQUIRE_CUDA_KERNELS=1.
    """
    if kernels.triton_for(x) is not None and not (torch.is_grad_enabled() and (x.requires_grad or up.requires_grad)):
        return fused_experts(x, weights, ids, up, down)
    return dispatch(x, weights, ids, up.shape[0], lambda e, part: relu2(part @ up[e].T) @ down[e].T)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, up, down) -> torch.Tensor:
    """`packed_experts` / `dense_experts` with both projections of all chosen experts in two grouped Triton
    launches (packed weights decoded in registers, dense ones read as they are; `moe.quant.kernels.triton`),
    without a host round trip. Needs triton, and two packed stacks in formats it supports or two dense stacks.

    Pairs whose id lies outside [0, E) (experts another rank holds) are skipped as `dispatch` skips them:
    sorted after every expert here, given no row tile, and left out of the sum.
    """
    from moe.quant.kernels import triton

    dense = isinstance(up, torch.Tensor)
    matmul = triton.grouped_dense_matmul if dense else triton.grouped_matmul
    E = up.shape[0] if dense else up.n_experts
    inside = (ids >= 0) & (ids < E)
    ids = torch.where(inside, ids, E)  # one bin past the last expert
    order, token_of, counts = sort_by_expert(ids, E + 1)
    tiles = triton.row_tiles(counts[:E], max_rows=token_of.shape[0])  # the bin past E: no tile, never computed
    h = matmul(x[token_of], up, tiles)
    y = matmul(relu2(h), down, tiles)
    return combine(y, weights, order, token_of, ids.shape[0], x.dtype, valid=inside.reshape(-1)[order])
