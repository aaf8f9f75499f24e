"""`PackedWeight`: one weight, or a stack of expert weights, held only as its packed tensors and scales.

The module's buffers are exactly the checkpoint's tensors for that weight (named as the producer names
them, see `moe.quant.codec`), so resident memory is the packed size and loading is a name-for-name copy.
Nothing dense is cached: `dequantize` builds the float weight (of one expert, when asked) on each call.

`PackedWeight` is also the interface by which the rest of the code recognises packed tensors: a module that
is an instance of it holds its format (`fmt`), its logical shape (`n_experts`, `out_features`,
`in_features`, `numel`) and buffers whose dtypes are the format's (model-wide dtype casts leave them alone).
Readers take one expert's tensors with `expert(e)` and every tensor, piece by piece, with `tensor_pieces()`.

`PackedExperts` is the same stack held as one set of tensors per expert instead of `[E, ...]` buffers: the
form the loader gives a CPU model, whose experts are then views of the checkpoint's memory map (published
checkpoints store one tensor per expert, so stacking them would copy every packed byte at load; llama.cpp
maps its GGUF the same way).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moe.quant.codec import QuantFormat


class PackedWeight(nn.Module):
    """A `[out, in]` weight, or `[n_experts, out, in]` when `n_experts` is given, stored in `fmt`.

    Buffers: `fmt.tensor_specs(out, in)` (each with the leading expert dim for a stack).
    """

    def __init__(self, fmt: QuantFormat, out_features: int, in_features: int, n_experts: int | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.fmt, self.out_features, self.in_features, self.n_experts = fmt, out_features, in_features, n_experts
        lead = () if n_experts is None else (n_experts,)
        for name, (shape, dtype) in fmt.tensor_specs(out_features, in_features).items():
            self.register_buffer(name, torch.zeros(lead + shape, dtype=dtype, device=device))

    def role(self, role: str) -> torch.Tensor | None:
        """The tensor playing `role` ("data", "scale", "global", "input"), or None if the format has none."""
        name = self.fmt.names.get(role)
        return getattr(self, name) if name is not None and role in self.fmt.roles else None

    def expert(self, e: int | None) -> dict[str, torch.Tensor]:
        """{role: tensor} of expert `e` of a stack (`e` None: of the whole weight), as stored."""
        t = {r: self.role(r) for r in self.fmt.roles}
        return t if e is None else {r: v[e] for r, v in t.items()}

    def dequantize(self, dtype: torch.dtype = torch.float32, expert: int | None = None) -> torch.Tensor:
        """The float weight `[out, in]` (of expert `expert` only, for a stack; the whole stack if None)."""
        return self.fmt.dequantize(self.expert(expert)).to(dtype)

    def activation_scale(self, expert: int | None = None) -> torch.Tensor | None:
        s = self.role("input")
        return s if s is None or expert is None else s[expert]

    def tensor_pieces(self) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, Iterator[torch.Tensor]]]:
        """(name, shape, dtype, pieces) of each stored tensor: `pieces` yields it whole, or for
        `PackedExperts` one expert at a time (the row-major slices of the `[E, ...]` stack it stands for)."""
        for name, t in self.named_buffers(recurse=False):
            yield name, tuple(t.shape), t.dtype, iter((t,))

    @property
    def numel(self) -> int:
        """Weights this module stands for: n_experts x out x in (the scales count as none)."""
        return (self.n_experts or 1) * self.out_features * self.in_features

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        stack = f"{self.n_experts} x " if self.n_experts is not None else ""
        return f"{stack}[{self.out_features}, {self.in_features}] {self.fmt.label}"


class PackedExperts(PackedWeight):
    """A stack of `len(experts)` packed `[out, in]` weights in `fmt`, held as one set of tensors per expert
    (for the CPU: `moe.quant.kernels.cpu` reads an expert's packed bytes wherever they are).

    `experts[e]` maps each tensor name of `fmt.tensor_specs(out, in)` to expert e's tensor, of that shape and
    dtype (or a shape differing only by size-1 dimensions, as producers store scalars and block scales),
    usually a read-only view of a checkpoint's memory map: it is never written. `state_dict()` gives the
    stacked `[E, ...]` tensors a `PackedWeight` stack has (copies); `load_state_dict` replaces the experts'
    tensors with copies of the given ones. Dtype casts leave it alone (as every packed tensor); moving it to
    another device raises (load the model on that device instead).

    Raises (constructor):
        ValueError: an expert lacks a tensor or has one of another size or dtype (names the expert and tensor).
    """

    def __init__(self, fmt: QuantFormat, out_features: int, in_features: int,
                 experts: list[dict[str, torch.Tensor]]):
        nn.Module.__init__(self)
        self.fmt, self.out_features, self.in_features, self.n_experts = fmt, out_features, in_features, len(experts)
        self.specs = fmt.tensor_specs(out_features, in_features)
        self.experts = [self._checked(e, part) for e, part in enumerate(experts)]

    def _checked(self, e: int, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if set(part) != set(self.specs):
            raise ValueError(f"PackedExperts: expert {e} has tensors {sorted(part)}, {self.fmt.label} needs "
                             f"{sorted(self.specs)}")
        out = {}
        for name, (shape, dtype) in self.specs.items():
            t = part[name]
            if t.dtype != dtype or t.numel() != torch.Size(shape).numel():
                raise ValueError(f"PackedExperts: expert {e}'s {name} is {t.dtype} {list(t.shape)}, {self.fmt.label} "
                                 f"needs {dtype} {list(shape)}")
            out[name] = t.reshape(shape)
        return out

    def role(self, role: str) -> torch.Tensor | None:
        raise RuntimeError("PackedExperts holds no [E, ...] stacks: read one expert's tensors with expert(e)")

    def expert(self, e: int | None) -> dict[str, torch.Tensor]:
        if e is None:
            return {r: torch.stack([p[self.fmt.names[r]] for p in self.experts]) for r in self.fmt.roles}
        return {r: self.experts[e][self.fmt.names[r]] for r in self.fmt.roles}

    def activation_scale(self, expert: int | None = None) -> torch.Tensor | None:
        if "input" not in self.fmt.roles:
            return None
        return self.expert(expert)["input"]

    def tensor_pieces(self):
        for name, (shape, dtype) in self.specs.items():
            yield name, (self.n_experts, *shape), dtype, (p[name] for p in self.experts)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.experts for t in p.values())

    # nn.Module extension hooks: the state dict holds the stacks a PackedWeight stack has
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.specs:
            destination[prefix + name] = torch.stack([p[name] for p in self.experts])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        given = {}
        for name, (shape, dtype) in self.specs.items():
            key, want = prefix + name, (self.n_experts, *shape)
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != want or state_dict[key].dtype != dtype:
                t = state_dict[key]
                error_msgs.append(f"size mismatch for {key}: copying {t.dtype} {tuple(t.shape)}, the model holds "
                                  f"{dtype} {want}")
            else:
                given[name] = state_dict[key]
        if len(given) == len(self.specs):
            self.experts = [{n: t[e].clone() for n, t in given.items()} for e in range(self.n_experts)]

    def _apply(self, fn, recurse=True):
        moved = fn(torch.empty(0, device=next(iter(self.experts[0].values())).device))
        if moved.device != next(iter(self.experts[0].values())).device:
            raise RuntimeError("a model whose experts are mapped from the checkpoint (PackedExperts) stays on its "
                               "device: load it on the device you need")
        return self  # dtype casts leave packed tensors alone
