"""The routed expert banks: every expert resident, only the selected ones computed, in three storages.

Experts are non-gated squared-ReLU MLPs (`y = down(relu(up(x)) ** 2)`, no gate_proj). Checkpoints store one
tensor per expert (`experts.{j}.up_proj.weight`); the loader stacks them into `up_proj [E, I, L]` and
`down_proj [E, L, I]` (L = hidden_size, or moe_latent_size with latent projections).

    ExpertBank           float stacks (the reference)
    QuantExpertBank      packed stacks (`moe.quant.PackedWeight`: FP8, NVFP4, MXFP4, ...); an expert's float
                         weights exist only while its matmul runs (none at all on the kernels)
    PrepackedExpertBank  bf16 experts prepacked for CPU inference (`moe.quant.kernels.prepacked`, beside the
                         kernel whose layout it holds)

All three run on `moe.quant.kernels.experts.dispatch`: the (token, expert) pairs sorted by expert, each chosen
expert over its contiguous slice of tokens, the weighted outputs summed per token in fp32; the packed bank's
forward is the operation `packed_experts` there, which picks its kernel beside that reference.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.quant.codec import QuantFormat
from moe.quant.kernels.experts import dense_experts, dispatch, expert_linear, packed_experts, relu2
from moe.quant.packed import PackedWeight


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
        overrides this and runs its forward by `dispatch_each`; calibration reads experts only through it."""
        return self.up_proj[e], self.down_proj[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return dense_experts(x, weights, ids, self.up_proj, self.down_proj)

    def dispatch_each(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The forward by `dispatch` over `weights_of` (the reference), for a bank whose experts live elsewhere."""
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
    packed matmul (each expert's product then on `expert_linear`, never fused). The forward is the operation
    `moe.quant.kernels.experts.packed_experts`, which picks the kernel.
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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.act_quant:
            return packed_experts(x, weights, ids, self.up_proj, self.down_proj, self.n_experts)
        return dispatch(x, weights, ids, self.n_experts,
                        lambda e, part: self._emulated(self.down_proj, relu2(self._emulated(self.up_proj, part, e)), e))

    @staticmethod
    def _emulated(proj: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's product of `proj` with its input quantize-dequantized first (`act_quant`) where packed."""
        if isinstance(proj, PackedWeight):
            x = proj.fmt.fake_quantize(x, proj.activation_scale(e))
        return expert_linear(x, proj, e)

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
