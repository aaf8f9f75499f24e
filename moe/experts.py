"""The routed expert banks: every expert resident, only the selected ones computed, in three storages.

Experts are non-gated squared-ReLU MLPs (`y = down(relu(up(x)) ** 2)`, no gate_proj). Checkpoints store one
tensor per expert (`experts.{j}.up_proj.weight`); the loader stacks them into `up_proj [E, I, L]` and
`down_proj [E, L, I]` (L = hidden_size, or moe_latent_size with latent projections).

    ExpertBank           float stacks (the reference)
    QuantExpertBank      packed stacks (`moe.quant.PackedWeight`: FP8, NVFP4, MXFP4, ...); an expert's float
                         weights exist only while its matmul runs (none at all in the fused Triton path)
    PrepackedExpertBank  bf16 experts prepacked for CPU inference (`moe.quant.prepacked`, `moe.quant.kernels.bf16`)

All three share `dispatch`: the (token, expert) pairs are sorted by expert and gathered once, each chosen
expert runs over its contiguous slice of tokens (on the CPU kernels all of them in one call: `group`),
experts nobody chose are never touched, and the weighted outputs are summed per token in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

import torch
from torch import nn

from moe.quant.codec import QuantFormat
from moe.quant import kernels
from moe.quant.kernels import bf16, cpu
from moe.quant.packed import PackedWeight
from moe.quant.prepacked import Prepacked


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, `relu(x) ** 2` (So et al. 2021, Primer): the activation of every Nemotron-H MLP."""
    return torch.relu(x).square()


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `ts` (one width) as one tensor: the only one itself, or their concatenation."""
    return ts[0] if len(ts) == 1 else torch.cat(ts)


# ------------------------------------------------------------------------------------------ dispatch
def _sort_by_expert(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (order of the flattened pairs sorted by expert (stable), the token of each sorted pair,
    tokens per expert [E])."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // ids.shape[1], torch.bincount(flat, minlength=n_experts)


def _combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor, T: int,
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
    order, token_of, counts = _sort_by_expert(ids, n_experts)
    counts = counts.tolist()[:n_experts]
    m = sum(counts)
    if m == 0:
        return x.new_zeros(T, x.shape[-1])
    order, token_of = order[:m], token_of[:m]
    parts = torch.split(x[token_of], counts)
    chosen = [e for e in range(n_experts) if counts[e]]
    ys = group(chosen, [parts[e] for e in chosen]) if group is not None else [expert(e, parts[e]) for e in chosen]
    return _combine(torch.cat(ys), weights, order, token_of, T, x.dtype)


# ------------------------------------------------------------------------------------------ float
class ExpertBank(nn.Module):
    """Shapes: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L] in x's dtype (summed in fp32)."""

    def __init__(self, n_experts: int, in_features: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(n_experts, intermediate_size, in_features))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, in_features, intermediate_size))

    @property
    def n_experts(self) -> int:
        return self.up_proj.shape[0]

    def weights_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (up [I, L], down [L, I]). A bank whose experts live elsewhere (streamed from files)
        overrides this; the forward and calibration read experts only through it."""
        return self.up_proj[e], self.down_proj[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        def expert(e: int, part: torch.Tensor) -> torch.Tensor:
            up, down = self.weights_of(e)
            return relu2(part @ up.T) @ down.T

        return dispatch(x, weights, ids, self.n_experts, expert)


# ------------------------------------------------------------------------------------------ packed
class DenseStack(nn.Module):
    """An unquantized `[E, out, in]` stack under the name `weight` (for a packed bank with one projection
    left in the model dtype, so checkpoint names stay `experts.{j}.down_proj.weight`)."""

    def __init__(self, n_experts: int, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, out_features, in_features, dtype=dtype, device=device))

    def dequantize(self, dtype: torch.dtype = torch.float32, expert: int | None = None) -> torch.Tensor:
        return (self.weight if expert is None else self.weight[expert]).to(dtype)


class QuantExpertBank(nn.Module):
    """The routed experts with packed weights. Shapes: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L].

    `up_proj` / `down_proj` are `PackedWeight` stacks (`[E, I, L]`, `[E, L, I]` in their formats) or, where
    a format is None, `DenseStack`s in `dtype`. `act_quant`: emulate activation quantization before each
    packed matmul. Memory during a forward: at most one expert's dequantized `up` and `down` at a time on the
    PyTorch path, none on the fused path (`fused`, CUDA with triton).
    """

    def __init__(self, n_experts: int, in_features: int, intermediate_size: int, up_fmt: QuantFormat | None,
                 down_fmt: QuantFormat | None, dtype: torch.dtype = torch.bfloat16, act_quant: bool = False,
                 device=None):
        super().__init__()
        self.n_experts, self.act_quant = n_experts, act_quant
        self.up_proj = self._projection(up_fmt, n_experts, intermediate_size, in_features, dtype, device)
        self.down_proj = self._projection(down_fmt, n_experts, in_features, intermediate_size, dtype, device)

    @staticmethod
    def _projection(fmt, n, out_f, in_f, dtype, device) -> nn.Module:
        if fmt is None:
            return DenseStack(n, out_f, in_f, dtype, device)
        fmt.check_shape(out_f, in_f, "QuantExpertBank")
        return PackedWeight(fmt, out_f, in_f, n_experts=n, device=device)

    def _matmul(self, proj: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
        if isinstance(proj, PackedWeight):
            if self.act_quant:
                x = proj.fmt.fake_quantize(x, proj.activation_scale(e))
            if (cpu := kernels.cpu_for(x, proj.fmt)) is not None:  # straight from the packed bytes
                return cpu.linear(x, proj, expert=e).to(x.dtype)
        return x @ proj.dequantize(x.dtype, expert=e).T

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.act_quant and all(isinstance(p, PackedWeight) for p in (self.up_proj, self.down_proj)) \
                and kernels.triton_for(x, self.up_proj.fmt, self.down_proj.fmt) is not None:
            return self.fused(x, weights, ids)
        group = self._group_cpu if not self.act_quant and all(
            isinstance(p, PackedWeight) and kernels.cpu_for(x, p.fmt) is not None for p in (self.up_proj, self.down_proj)
        ) else None
        return dispatch(x, weights, ids, self.n_experts,
                        lambda e, part: self._matmul(self.down_proj, relu2(self._matmul(self.up_proj, part, e)), e),
                        group)

    def _group_cpu(self, chosen: list[int], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Experts `chosen` over their inputs `xs` on the CPU kernels: their up projections in one call of the
        extension, then their down projections in another; the same operations as `_matmul` otherwise, each
        elementwise step done once over all the experts' rows (a decode step's fixed cost is its call count)."""
        sizes, dtype = [x.shape[0] for x in xs], xs[0].dtype
        h = relu2(_cat(cpu.linear_group(xs, self.up_proj, chosen)).to(dtype))
        y = _cat(cpu.linear_group(list(cpu.kernel_input(h).split(sizes)), self.down_proj, chosen)).to(dtype)
        return list(y.split(sizes))

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The forward with both projections of all chosen experts in two grouped Triton launches (weights
        decoded in registers; `moe.quant.kernels.triton`). Needs triton and two supported packed formats.

        Pairs whose id lies outside [0, E) (experts another rank holds) are skipped as `dispatch` skips them:
        sorted after every expert here, given no row tile, and left out of the sum (without a host round trip).
        """
        from moe.quant.kernels import triton

        E = self.n_experts
        inside = (ids >= 0) & (ids < E)
        ids = torch.where(inside, ids, E)  # one bin past the last expert
        order, token_of, counts = _sort_by_expert(ids, E + 1)
        tiles = triton.row_tiles(counts[:E])  # rows of the bin past E: no tile, never computed
        h = triton.grouped_matmul(x[token_of], self.up_proj, tiles)
        y = triton.grouped_matmul(relu2(h), self.down_proj, tiles)
        return _combine(y, weights, order, token_of, ids.shape[0], x.dtype, valid=inside.reshape(-1)[order])

    @classmethod
    def from_bank(cls, bank: ExpertBank, up_fmt: QuantFormat | None, down_fmt: QuantFormat | None,
                  up_amax: torch.Tensor | None = None, down_amax: torch.Tensor | None = None,
                  act_quant: bool = False) -> "QuantExpertBank":
        """Quantize a float `ExpertBank` (`up_proj [E, I, L]`, `down_proj [E, L, I]`); `*_amax` [E]: the
        calibrated input amax per expert, for formats with a static input scale."""
        up, down = bank.up_proj.detach(), bank.down_proj.detach()
        E, I, L = up.shape
        q = cls(E, L, I, up_fmt, down_fmt, up.dtype, act_quant, up.device)
        for proj, w, fmt, amax in ((q.up_proj, up, up_fmt, up_amax), (q.down_proj, down, down_fmt, down_amax)):
            if fmt is None:
                proj.weight.data.copy_(w)
                continue
            for name, t in fmt.quantize(w, amax).items():
                getattr(proj, name).copy_(t)
        return q


# ------------------------------------------------------------------------------------------ prepacked
class PrepackedExpertBank(Prepacked):
    """An inference-only `ExpertBank` (bf16, CPU) holding each expert's two matrices prepacked
    (`moe.quant.kernels.bf16`).

    Shapes as `ExpertBank`. The ReLU of squared ReLU is fused into the up projection.
    """

    def __init__(self, source: ExpertBank, experts: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Pack `source`'s experts, or the (up [I, L], down [L, I]) bf16 pairs `experts` yields when given
        (`source` may then be on meta): one expert at a time, so a loader can hand over each and drop it."""
        super().__init__()
        self.n_experts = source.n_experts
        self.shapes = {"up_proj": tuple(source.up_proj.shape), "down_proj": tuple(source.down_proj.shape)}
        self.up, self.down = [], []
        for up, down in experts if experts is not None else (source.weights_of(e) for e in range(self.n_experts)):
            self.up.append(bf16.pack(up))
            self.down.append(bf16.pack(down))

    @property
    def up_proj(self) -> torch.Tensor:
        """[E, I, L] dense (a copy)."""
        return torch.stack([bf16.unpack(w) for w in self.up])

    @property
    def down_proj(self) -> torch.Tensor:
        """[E, L, I] dense (a copy)."""
        return torch.stack([bf16.unpack(w) for w in self.down])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return dispatch(x, weights, ids, self.n_experts, lambda e, part: bf16.linear(
            bf16.linear(part, self.up[e], relu=True).square(), self.down[e]), self._group)

    def _group(self, chosen: list[int], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Experts `chosen` over their inputs `xs`: their up projections in one kernel call, then the downs
        (`bf16.linear_group`: one call while every input has at most `DECODE_ROWS` rows, else one each)."""
        h = _cat(bf16.linear_group(xs, [self.up[e] for e in chosen], relu=True)).square()
        return bf16.linear_group(list(h.split([x.shape[0] for x in xs])), [self.down[e] for e in chosen])

    def dense_pieces(self):
        """(name, [E, out, in], its E experts' dense weights one at a time), for `up_proj` and `down_proj`."""
        for name, packs in (("up_proj", self.up), ("down_proj", self.down)):
            yield name, self.shapes[name], (bf16.dense(w) for w in packs)

    def to_plain(self) -> ExpertBank:
        """The `ExpertBank` with these weights (dense copies)."""
        up = self.up_proj
        with torch.device("meta"):  # built empty, then given the dense weights
            plain = ExpertBank(self.n_experts, up.shape[2], up.shape[1])
        plain.up_proj, plain.down_proj = nn.Parameter(up), nn.Parameter(self.down_proj)
        return plain

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.shapes

    def dense_tensor(self, name: str) -> torch.Tensor:
        return self.up_proj if name == "up_proj" else self.down_proj

    def repack(self, name: str, dense: torch.Tensor) -> None:
        setattr(self, "up" if name == "up_proj" else "down", [bf16.pack(w) for w in dense])
