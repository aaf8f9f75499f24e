"""`QuantExpertBank`: the routed experts with packed weights; only the selected experts are dequantized.

Same interface and dispatch as `moe.experts.ExpertBank` (squared-ReLU experts `down(relu(up(x))^2)`,
token/expert pairs sorted by expert, one matmul pair per chosen expert, fp32 combine), but each
projection is a `PackedWeight` stack (`up_proj: [E, I, L]`, `down_proj: [E, L, I]` in some format), and
an expert's float weights exist only while its matmul runs. Memory during a forward: at most one
expert's dequantized `up` and `down` at a time on the PyTorch path, none on the Triton path.

A projection may also be left unquantized (`fmt=None`): it is then a `PackedWeight`-like holder of a
plain float stack named `weight` (so checkpoint names stay `experts.{j}.down_proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe.experts import dispatch, relu2
from moe.quant.activations import fake_quantize_input
from moe.quant.format import QuantFormat
from moe.quant.packed import PackedWeight


class DenseStack(nn.Module):
    """An unquantized `[E, out, in]` stack under the name `weight` (for a bank with one projection packed)."""

    def __init__(self, n_experts: int, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, out_features, in_features, dtype=dtype, device=device))
        self.fmt = None

    def dequantize(self, dtype: torch.dtype = torch.float32, expert: int | None = None) -> torch.Tensor:
        return (self.weight if expert is None else self.weight[expert]).to(dtype)

    def activation_scale(self, expert: int | None = None) -> None:
        return None


class QuantExpertBank(nn.Module):
    """Shapes: x [T, L], weights [T, k] fp32, ids [T, k] -> [T, L] in x's dtype (summed in fp32).

    `up_fmt` / `down_fmt`: the format of each projection (None = keep it in `dtype`).
    `act_quant`: emulate activation quantization before each packed matmul.
    """

    def __init__(self, n_experts: int, in_features: int, intermediate_size: int, up_fmt: QuantFormat | None,
                 down_fmt: QuantFormat | None, dtype: torch.dtype = torch.bfloat16, act_quant: bool = False,
                 device=None):
        super().__init__()
        self.n_experts, self.act_quant = n_experts, act_quant
        self.up_proj = self._projection(up_fmt, n_experts, intermediate_size, in_features, dtype, device)
        self.down_proj = self._projection(down_fmt, n_experts, in_features, intermediate_size, dtype, device)

    @staticmethod
    def _projection(fmt, n, out_f, in_f, dtype, device):
        if fmt is None:
            return DenseStack(n, out_f, in_f, dtype, device)
        fmt.check_shape(out_f, in_f, "QuantExpertBank")
        return PackedWeight(fmt, out_f, in_f, n_experts=n, device=device)

    def _matmul(self, proj, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.act_quant and proj.fmt is not None:
            x = fake_quantize_input(x, proj.fmt, proj.activation_scale(e))
        return x @ proj.dequantize(x.dtype, expert=e).T

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not self.act_quant:
            from moe.quant import triton_kernels

            if triton_kernels.supports_bank(self):
                return triton_kernels.expert_bank(x, weights, ids, self)
        return dispatch(x, weights, ids, self.n_experts,
                        lambda e, part: self._matmul(self.down_proj, relu2(self._matmul(self.up_proj, part, e)), e))

    @classmethod
    def from_bank(cls, bank: nn.Module, up_fmt: QuantFormat | None, down_fmt: QuantFormat | None,
                  up_amax: torch.Tensor | None = None, down_amax: torch.Tensor | None = None,
                  act_quant: bool = False) -> "QuantExpertBank":
        """Quantize a float `moe.experts.ExpertBank` (`up_proj [E, I, L]`, `down_proj [E, L, I]`)."""
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
