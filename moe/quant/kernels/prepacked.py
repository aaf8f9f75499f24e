"""Modules whose bf16 weights are held prepacked for CPU inference (`moe.quant.kernels.bf16`: as a plain copy
for this project's dot-product kernel where the CPU has it, else in oneDNN's blocked layout). They hold that
kernel's layout, so they live beside it; `moe.prepack` swaps them in at load and back to the plain modules.

`Prepacked` is what every such module shares (`PrepackedLinear`, `PrepackedExpertBank`):
the math is that of the plain module it replaces (bf16 inputs and weights, fp32 accumulation, bf16 output;
only the summation order inside a dot product differs), and the packed weight is the only copy kept.
`state_dict()` and the weight attributes still give the dense tensors under the plain module's names (read
back from the packed layout: a copy, so writing into it changes nothing), and `load_state_dict` repacks
what it is given. A prepacked module is for inference only: a change of dtype or device raises (load the
model that way instead), and its packed weights are not parameters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moe.quant.kernels import bf16
from moe.quant.kernels.experts import cat, dispatch


class Prepacked(nn.Module):
    """The interface of a module holding prepacked bf16 weights: `dense_shapes()` names the dense tensors
    it stands for, `dense_tensors()` reads them back one at a time, `repack(name, dense)` replaces one."""

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the dense bf16 tensors the packed ones stand for (as the plain module names them)."""
        raise NotImplementedError

    def dense_tensor(self, name: str) -> torch.Tensor:
        """Dense tensor `name` (a bf16 copy read back from the packed layout)."""
        raise NotImplementedError

    def repack(self, name: str, dense: torch.Tensor) -> None:
        """Replace the packed form of dense tensor `name` (bf16, of the shape `dense_shapes` gives)."""
        raise NotImplementedError

    def dense_pieces(self) -> Iterator[tuple[str, tuple[int, ...], Iterator[torch.Tensor]]]:
        """(name, shape, pieces) of each dense tensor, in `dense_shapes` order: `pieces` yields it in row-major
        slices when iterated (here the whole tensor, read back by `dense_tensor`; an expert bank overrides
        this to give one expert at a time). For readers of every byte (the identity's digest); the pieces
        may be the stored tensors themselves: never write into them."""
        for name, shape in self.dense_shapes().items():
            yield name, shape, (self.dense_tensor(n) for n in (name,))

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, dense copy) of each packed tensor, one at a time, in `dense_shapes` order."""
        for name in self.dense_shapes():
            yield name, self.dense_tensor(name)

    # nn.Module extension hooks: the state dict holds the dense tensors under the plain module's names
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self.dense_tensors():  # first, as the plain module lists its weights before a bias
            destination[prefix + name] = t
        super()._save_to_state_dict(destination, prefix, keep_vars)  # registered tensors (a bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name, shape in self.dense_shapes().items():
            key = prefix + name
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)}, the shape in the current model is {shape}")
            else:
                self.repack(name, state_dict[key].detach().to(torch.bfloat16))

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=torch.bfloat16))
        if probe.dtype != torch.bfloat16 or probe.device.type != "cpu":
            raise RuntimeError("a model with prepacked weights stays bf16 on the CPU: load it in the dtype and "
                               "on the device you need, or with prepack=False")
        return super()._apply(fn, recurse)


class PrepackedLinear(Prepacked):
    """An inference-only `nn.Linear` (bf16, CPU) holding its weight prepacked. Shapes: [..., in] -> [..., out]."""

    def __init__(self, source: nn.Linear, weight: torch.Tensor | None = None):
        """Pack `source.weight` (or `weight`, [out, in] bf16, when given: `source` may then be on meta; its
        bias is kept either way)."""
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.packed = bf16.pack(source.weight if weight is None else weight)
        self.bias = source.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in] bf16 (a copy read back from the packed layout)."""
        return bf16.unpack(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16.linear(x, self.packed, self.bias)

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.out_features, self.in_features)}

    def dense_tensor(self, name: str) -> torch.Tensor:
        return self.weight

    def repack(self, name: str, dense: torch.Tensor) -> None:
        self.packed = bf16.pack(dense)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PrepackedExpertBank(Prepacked):
    """An inference-only `moe.experts.ExpertBank` (bf16, CPU) holding each expert's two matrices prepacked.

    Shapes as `ExpertBank`: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L] bf16 (summed in fp32). The ReLU
    of squared ReLU is fused into the up projection.
    """

    def __init__(self, source: nn.Module, experts: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Pack the experts of `source` (an `ExpertBank`), or the (up [I, L], down [L, I]) bf16 pairs `experts`
        yields when given (`source` may then be on meta): one expert at a time, so a loader can hand over each
        and drop it."""
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
        h = cat(bf16.linear_group(xs, [self.up[e] for e in chosen], relu=True)).square()
        return bf16.linear_group(list(h.split([x.shape[0] for x in xs])), [self.down[e] for e in chosen])

    def dense_pieces(self):
        """(name, [E, out, in], its E experts' dense weights one at a time), for `up_proj` and `down_proj`."""
        for name, packs in (("up_proj", self.up), ("down_proj", self.down)):
            yield name, self.shapes[name], (bf16.dense(w) for w in packs)

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.shapes

    def dense_tensor(self, name: str) -> torch.Tensor:
        return self.up_proj if name == "up_proj" else self.down_proj

    def repack(self, name: str, dense: torch.Tensor) -> None:
        setattr(self, "up" if name == "up_proj" else "down", [bf16.pack(w) for w in dense])
