"""`QuantLinear`: an `nn.Linear` replacement whose weight stays packed (FP8, NVFP4, MXFP4 or any registered format).

    y = x @ dequantize(W).T + bias         weight-only (W8A16 / W4A16), the default
    y = q(x) @ dequantize(W).T + bias      with `act_quant=True`: inputs quantize-dequantized first in the
                                           format's activation format (W8A8 / W4A4 emulation)

The state dict holds the checkpoint's own tensors (`weight`, `weight_scale`, ... as `fmt` names them) and
an optional `bias` in the model dtype. On CUDA, with triton installed, FP8 and NVFP4 weight-only matmuls
run in a Triton kernel that dequantizes tiles on the fly (`moe.quant.kernels.triton`); on the CPU they run
straight from the packed bytes (`moe.quant.kernels.cpu`); where neither is available the dequantized weight
is built for the call and dropped after it.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.quant import kernels
from moe.quant.codec import QuantFormat
from moe.quant.packed import PackedWeight


class QuantLinear(PackedWeight):
    """Shapes: x [..., in_features] -> [..., out_features] in x's dtype (the model's compute dtype)."""

    def __init__(self, fmt: QuantFormat, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, act_quant: bool = False,
                 device: torch.device | str | None = None):
        """`dtype`: the bias's dtype. Raises ValueError when `fmt` cannot store an [out, in] weight."""
        fmt.check_shape(out_features, in_features, "QuantLinear")
        super().__init__(fmt, out_features, in_features, device=device)
        self.act_quant = act_quant
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = self.fmt.fake_quantize(x, self.activation_scale())
        return kernels.packed_linear(x, self, self.bias, fused=not self.act_quant)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat, input_amax: torch.Tensor | None = None,
                    act_quant: bool = False) -> "QuantLinear":
        """Quantize a float `nn.Linear` (its weight is read, not kept)."""
        w = linear.weight.detach()
        q = cls(fmt, linear.in_features, linear.out_features, linear.bias is not None, w.dtype, act_quant, w.device)
        for name, t in fmt.quantize(w, input_amax).items():
            getattr(q, name).copy_(t)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q
