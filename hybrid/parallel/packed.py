"""Packed (FP8, NVFP4, MXFP4) weights under tensor parallelism: each tensor of a packed module cut at whole
scale blocks.

A packed `[out, in]` weight is several tensors (data, block scales, scalars), each covering the weight's rows and
columns in its own steps (`QuantFormat.units`: an FP8-block scale row covers 128 weight rows, an NVFP4 byte two
columns). The dense weight's shard (`ShardPlan.shard`) is carried over to every tensor of the module:

    split by columns (row-parallel o_proj, out_proj, down_proj)   each range must start and end on a block
        boundary (or at the weight's end); the plan already refuses a config where it would not (`ShardPlan`),
        and here a ValueError is the backstop
    split by rows (column-parallel q/k/v, in_proj, up_proj)         a range that cuts a block is widened to
        whole blocks: the rank holds the union of those rows (a few extra rows, e.g. the 64 `dt` rows of a Nano
        Mamba `in_proj` share one FP8 128-row block across every rank), and the module's output is narrowed to
        the rank's own rows by an `index_select` after it (`RowSubset.keep`)
    a tensor without that dimension (a per-tensor scale, a global scale, an input scale, a per-channel scale
        under a column split)                                      replicated

Routed experts stay whole on their rank (the plan splits the expert index), so their tensors need no rule here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.parallel.plan import REPLICATE, Shard, ShardPlan
from moe.quant import QuantLinear


@dataclass(frozen=True)
class RowSubset:
    """A column-parallel packed module whose rank holds more rows than its own: `held` (ranges of the full
    weight's rows, concatenated) and `keep` (indices into the held rows of the rank's rows, in order)."""

    held: tuple[tuple[int, int], ...]
    keep: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(b - a for a, b in self.held)


def packed_shards(model, plan: ShardPlan) -> tuple[dict[str, Shard], dict[str, RowSubset]]:
    """For the full quantized model on meta (`hybrid.quantization.quantize_modules` applied): ({state-dict name
    of every tensor of each sharded `QuantLinear`: its Shard}, {module name: RowSubset} of the modules whose
    rank holds extra rows).

    Raises:
        ValueError: a column split that cuts a scale block (names the module, its format, the block and the
            columns).
    """
    shards, subsets = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        dense = plan.shard_of(f"{name}.weight")
        if dense.kind != "split":
            continue
        units = module.fmt.units()
        if dense.dim == 0:
            held = _widened(dense.ranges, module.fmt.step(0), module.out_features)
            if held != dense.ranges:
                subsets[name] = RowSubset(held, _keep(held, dense.ranges))
            if module.bias is not None:
                shards[f"{name}.bias"] = Shard("split", 0, held)
        else:
            held, step = dense.ranges, module.fmt.step(1)
            for a, b in held:
                if a % step or (b % step and b != module.in_features):
                    raise ValueError(f"tensor parallelism: `{name}` ({module.fmt.label}) takes input columns "
                                     f"[{a}, {b}) on rank {plan.rank} of {plan.world}, which cuts its scale blocks "
                                     f"of {step} columns")
        for tensor, unit in units.items():
            u = unit[dense.dim]
            shards[f"{name}.{tensor}"] = REPLICATE if u is None else Shard(
                "split", dense.dim, tuple((a // u, -(-b // u)) for a, b in held))
    return shards, subsets


def _widened(ranges, step: int, n: int) -> tuple[tuple[int, int], ...]:
    """`ranges` widened to multiples of `step` (the last clipped at `n`), overlapping ones merged."""
    out: list[list[int]] = []
    for a, b in ranges:
        a, b = a // step * step, min(-(-b // step) * step, n)
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _keep(held, ranges) -> tuple[int, ...]:
    """The positions, in the concatenation of the `held` ranges, of the rows of `ranges` (in their order)."""
    position = {row: i for i, row in enumerate(r for a, b in held for r in range(a, b))}
    return tuple(position[row] for a, b in ranges for row in range(a, b))


def narrow_outputs(model, subsets: dict[str, RowSubset]) -> None:
    """Give each module of `subsets` in the loaded rank model a forward hook that keeps the rank's own output
    features (`RowSubset.keep`), so the layers see the shapes of an exact split."""
    for name, subset in subsets.items():
        keep = torch.tensor(subset.keep, dtype=torch.long)

        def select(module, inputs, output, keep=keep):
            return output.index_select(-1, keep.to(output.device))

        model.get_submodule(name).register_forward_hook(select)
