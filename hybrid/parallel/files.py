"""A checkpoint's files as one rank sees them: every tensor cut to the rank's part before it is read.

`ShardedFiles` stands in for `hybrid.checkpoint_files.CheckpointFiles` in the loader (`hybrid.loading`), so the
strict loading rules stay one piece of code: a tensor's `shape` is the rank's part of it, `view` reads only that
part of the memory map (a view where the part is one contiguous row range; a copy of the ranges otherwise),
and the routed experts of other ranks are not there at all (rank r sees `experts.{e0 + j}` as `experts.{j}`).
Every file tensor is first checked against the full model's shape (a file with the wrong shape is refused, not
sliced). `read_bytes` counts the bytes of the file tensors' parts this rank took, in the files' dtypes (a bf16
checkpoint loaded as fp32 reads half the bytes it holds).
"""

from __future__ import annotations

import re

import torch

from hybrid.checkpoint_files import CheckpointError, CheckpointFiles
from hybrid.parallel.plan import Shard, ShardPlan
from moe.quant import PackedWeight

_STACK = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<proj>up_proj|down_proj)(?P<tensor>\.\w+)?$")
_EXPERT = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<j>\d+)\.(?P<rest>.+)$")


class ShardedFiles:
    """Rank `plan.rank`'s view of `files`. `full_shapes`: {file tensor name: its shape in the full model}
    (`full_shapes`); names it lacks (tensors the model does not use) are shown unsliced, for the loader to
    refuse."""

    def __init__(self, files: CheckpointFiles, plan: ShardPlan, full_shapes: dict[str, tuple[int, ...]],
                 shards: dict[str, Shard] | None = None, packed: frozenset[str] = frozenset()):
        self.files, self.plan, self.full_shapes = files, plan, full_shapes
        self.shards, self.packed = shards or {}, packed
        self.directory = files.directory
        self.read_bytes = 0
        e0, e1 = plan.experts
        self._file_of_local: dict[str, str] = {}
        for name in files.keys():
            m = _EXPERT.match(name)
            if m is None:
                self._file_of_local[name] = name
            elif e0 <= int(m["j"]) < e1:
                self._file_of_local[f"{m['prefix']}.{int(m['j']) - e0}.{m['rest']}"] = name
            elif int(m["j"]) >= plan.config.n_routed_experts:  # no rank uses it: left for the loader to refuse
                self._file_of_local[name] = name

    def keys(self) -> list[str]:
        return list(self._file_of_local)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of_local

    def _source(self, name: str) -> str:
        return self._file_of_local[name]

    def _shard(self, name: str):
        """(file tensor name, its shape, this rank's Shard or None). A packed tensor stored with other size-1
        dimensions than the model's (a scalar as [] or [1], ModelOpt's [R, 1, C, 1] block scales) is taken in
        the model's shape when it is split."""
        source = self._source(name)
        shape, full = tuple(self.files.shape(source)), self.full_shapes.get(source)
        if full is None:
            return source, shape, None
        shard = self.shards.get(source) or self.plan.shard_of(source)
        if shape != full:
            if source not in self.packed or _squeezed(shape) != _squeezed(full):
                raise CheckpointError(f"{self.files.file_of(source)}: tensor {source!r} has shape {list(shape)}; "
                                      f"the config expects {list(full)}")
            if shard.kind == "split":
                shape = full
        return source, shape, shard

    def shape(self, name: str) -> tuple[int, ...]:
        _, shape, shard = self._shard(name)
        return shape if shard is None else shard.local_shape(shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(self._source(name))

    def nbytes(self, name: str) -> int:
        _, shape, shard = self._shard(name)
        local = shape if shard is None else shard.local_shape(shape)
        n = 1
        for d in local:
            n *= d
        return n * self.dtype(name).itemsize

    def view(self, name: str) -> torch.Tensor:
        """This rank's part of tensor `name`: a read-only view of the map (one row range, or the whole tensor),
        a new tensor (several ranges, or a column range), or zeros (a row-parallel bias off rank 0)."""
        source, shape, shard = self._shard(name)
        full = self.files.view(source)
        if tuple(full.shape) != shape:
            full = full.reshape(shape)
        if shard is None or shard.kind == "replicate":
            out = full
        elif shard.kind == "rank0":
            out = full if self.plan.rank == 0 else torch.zeros_like(full)
        else:
            parts = [full.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
            out = parts[0] if len(parts) == 1 and shard.dim == 0 else torch.cat(parts, dim=shard.dim)
        if shard is None or shard.kind != "rank0" or self.plan.rank == 0:
            self.read_bytes += out.numel() * out.element_size()
        return out

    def release(self, name: str) -> None:
        self.files.release(self._source(name))

    def file_of(self, name: str):
        return self.files.file_of(self._source(name))


def full_shapes(model) -> dict[str, tuple[int, ...]]:
    """{checkpoint tensor name: shape} of a full (unsharded) model on meta: its state dict, the stacked expert
    tensors also under their per-expert names (`...experts.{j}.up_proj.weight`, and each tensor of a packed
    stack: `...experts.{j}.up_proj.weight_scale`)."""
    shapes = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(t.shape)
        m = _STACK.match(name)
        if m:
            for j in range(t.shape[0]):
                shapes[f"{m['prefix']}.{j}.{m['proj']}{m['tensor'] or '.weight'}"] = tuple(t.shape[1:])
    return shapes


def packed_names(model) -> frozenset[str]:
    """The checkpoint names of every tensor of the packed modules of a full model on meta (stacks also under
    their per-expert names): the tensors `ShardedFiles` takes in the model's shape up to size-1 dimensions."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, PackedWeight):
            for tensor, t in module.named_buffers(recurse=False):
                name = f"{module_name}.{tensor}"
                names.add(name)
                m = _STACK.match(name)
                if m and module.n_experts is not None:
                    names.update(f"{m['prefix']}.{j}.{m['proj']}{m['tensor']}" for j in range(module.n_experts))
    return frozenset(names)


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)
