"""bf16 linears on CPU through oneDNN with weights reordered once, at load, into its blocked layout.

Why: on an AVX-512-BF16 CPU (2 threads), eager `x @ W.T` with a bf16 weight reads the weight at 20-26 GB/s
when x is a single row (decode), while oneDNN's inner-product primitive on a prepacked weight reads it at
28 GB/s (640 x 1024, an expert) to 46 GB/s (12352 x 2048), and runs prompt-sized GEMMs at about 430
GFLOP/s (measured; `scripts/bench.py` shows the effect on whole models). This is the path
PyTorch's inductor takes for frozen bf16 linears on CPU
(`torch.ops.mkldnn._reorder_linear_weight` once, `torch.ops.mkldnn._linear_pointwise` per call).

`prepack(model)` swaps, in place, every bf16 `nn.Linear` for a `PackedLinear` and every bf16 `ExpertBank` for
a `PackedExpertBank`. The math is that of the modules they replace (bf16 inputs and weights, fp32
accumulation, bf16 output); only the summation order inside a dot product differs. The packed weight is
the only copy kept. `state_dict()` and `.weight` still give the dense tensors under the same names (read
back from the packed layout; `.weight` is a copy, so writing into it changes nothing), so saving,
fingerprints and accounting see the model unchanged, and `load_state_dict` repacks what it is given.
A packed model is for inference only: `prepack` freezes every parameter (a backward pass raises instead
of silently leaving the packed weights without gradients), a change of dtype or device raises (load the
model that way instead), and `model.parameters()` no longer lists the packed weights.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moe.experts import ExpertBank, dispatch


def available() -> bool:
    """True when this PyTorch build has oneDNN with bf16 support on this CPU (AVX-512-BF16 or AMX)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 (CPU) -> the same matrix as an opaque oneDNN tensor in its blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """`x @ W.T + bias` (then ReLU when `relu`): x [..., in] bf16, packed from `pack(W)` -> [..., out] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "relu" if relu else "none", [], "")


class _Packed(nn.Module):
    """What both packed modules share: dense tensors in `state_dict` under the plain module's names, repacked
    by `load_state_dict`, and no dtype or device change."""

    def _dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the dense tensors the packed ones stand for (read back by `getattr(self, name)`)."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self._dense_shapes():  # first, as the plain module lists its weights before a bias
            destination[prefix + name] = getattr(self, name)
        super()._save_to_state_dict(destination, prefix, keep_vars)  # registered tensors (a bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name, shape in self._dense_shapes().items():
            key = prefix + name
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)}, the shape in the current model is {shape}")
            else:
                self._repack(name, state_dict[key].detach().to(torch.bfloat16))

    def _repack(self, name: str, dense: torch.Tensor) -> None:
        """Replace the packed form of dense tensor `name` (bf16, the shape `_dense_shapes` gives)."""
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=torch.bfloat16))
        if probe.dtype != torch.bfloat16 or probe.device.type != "cpu":
            raise RuntimeError("a model with oneDNN-prepacked weights stays bf16 on the CPU: load it in the dtype and "
                               "on the device you need, or with prepack=False")
        return super()._apply(fn, recurse)


class PackedLinear(_Packed):
    """An inference-only `nn.Linear` (bf16, CPU) holding its weight packed. Shapes: [..., in] -> [..., out]."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.packed = pack(source.weight)
        self.bias = source.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in] bf16 (a copy read back from the packed layout)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)

    def _dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.out_features, self.in_features)}

    def _repack(self, name: str, dense: torch.Tensor) -> None:
        self.packed = pack(dense)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedExpertBank(_Packed):
    """An inference-only `ExpertBank` (bf16, CPU) holding each expert's two matrices packed.

    Shapes as `ExpertBank`: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L]. The ReLU of squared ReLU is
    fused into the up projection.
    """

    def __init__(self, source: ExpertBank):
        super().__init__()
        self.n_experts = source.up_proj.shape[0]
        self._shapes = {"up_proj": tuple(source.up_proj.shape), "down_proj": tuple(source.down_proj.shape)}
        self.up = [pack(w) for w in source.up_proj]
        self.down = [pack(w) for w in source.down_proj]

    @property
    def up_proj(self) -> torch.Tensor:
        """[E, I, L] dense (a copy)."""
        return torch.stack([w.to_dense() for w in self.up])

    @property
    def down_proj(self) -> torch.Tensor:
        """[E, L, I] dense (a copy)."""
        return torch.stack([w.to_dense() for w in self.down])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return dispatch(x, weights, ids, self.n_experts,
                        lambda e, part: linear(linear(part, self.up[e], relu=True).square(), self.down[e]))

    def _dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._shapes

    def _repack(self, name: str, dense: torch.Tensor) -> None:
        setattr(self, "up" if name == "up_proj" else "down", [pack(w) for w in dense])


def prepack(model: nn.Module) -> int:
    """Swap the bf16 `nn.Linear`s and `ExpertBank`s of `model` (on CPU) for packed ones, in place.

    Modules in other dtypes (fp32 routers, fp32 models) or on other devices are left as they are, and so are
    quantized modules (`moe.quant`). Returns the number of modules swapped.
    Raises:
        RuntimeError: this CPU or PyTorch build has no oneDNN bf16 support (check `available()` first).
    """
    if not available():
        raise RuntimeError("oneDNN bf16 is not available on this CPU / PyTorch build")
    shared = {p.data_ptr() for m in model.modules() if not isinstance(m, (nn.Linear, ExpertBank))
              for p in m.parameters(recurse=False)}  # a head tied to the embedding stays dense: one copy

    def packed(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Linear and _eligible(child.weight, shared):
            return PackedLinear(child)
        if type(child) is ExpertBank and _eligible(child.up_proj, shared):
            return PackedExpertBank(child)
        return None

    swapped = _swap_children(model, packed)
    model.requires_grad_(False)
    return swapped


def unpack(model: nn.Module) -> int:
    """Swap every `PackedLinear` / `PackedExpertBank` of `model` back to a plain module with dense weights,
    in place (what quantizing or training needs), and make its parameters trainable again, as after a plain
    load. Returns the number of modules swapped."""

    def plain(child: nn.Module) -> nn.Module | None:
        if not isinstance(child, _Packed):
            return None
        with torch.device("meta"):  # built empty, then given the dense weights
            if isinstance(child, PackedLinear):
                module = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                module.weight, module.bias = nn.Parameter(child.weight), child.bias
            else:
                up = child.up_proj
                module = ExpertBank(child.n_experts, up.shape[2], up.shape[1])
                module.up_proj, module.down_proj = nn.Parameter(up), nn.Parameter(child.down_proj)
        return module

    swapped = _swap_children(model, plain)
    if swapped:
        model.requires_grad_(True)
    return swapped


def _swap_children(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replace every submodule for which `replacement(module)` returns a module, one at a time (popped from
    the list, so each original is freed as soon as its replacement exists). Returns the count."""
    children = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    swapped = 0
    while children:
        parent, name, child = children.pop()
        new = replacement(child)
        if new is not None:
            setattr(parent, name, new)
            swapped += 1
    return swapped


def _eligible(weight: torch.Tensor, shared: set[int]) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.data_ptr() not in shared
