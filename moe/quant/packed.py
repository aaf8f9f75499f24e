"""`PackedWeight`: one weight, or a stack of expert weights, held only as its packed tensors and scales.

The module's buffers are exactly the checkpoint's tensors for that weight (named as the producer names
them, see `moe.quant.codec`), so resident memory is the packed size and loading is a name-for-name copy.
Nothing dense is cached: `dequantize` builds the float weight (of one expert, when asked) on each call.

`PackedWeight` is also the interface by which the rest of the code recognises packed tensors: a module that
is an instance of it holds its format (`fmt`), its logical shape (`n_experts`, `out_features`,
`in_features`, `numel`) and buffers whose dtypes are the format's (model-wide dtype casts leave them alone).
"""

from __future__ import annotations

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

    def dequantize(self, dtype: torch.dtype = torch.float32, expert: int | None = None) -> torch.Tensor:
        """The float weight `[out, in]` (of expert `expert` only, for a stack; the whole stack if None)."""
        t = {r: self.role(r) for r in self.fmt.roles}
        if expert is not None:
            t = {r: v[expert] for r, v in t.items()}
        return self.fmt.dequantize(t).to(dtype)

    def activation_scale(self, expert: int | None = None) -> torch.Tensor | None:
        s = self.role("input")
        return s if s is None or expert is None else s[expert]

    @property
    def numel(self) -> int:
        """Weights this module stands for: n_experts x out x in (the scales count as none)."""
        return (self.n_experts or 1) * self.out_features * self.in_features

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        stack = f"{self.n_experts} x " if self.n_experts is not None else ""
        return f"{stack}[{self.out_features}, {self.in_features}] {self.fmt.label}"
