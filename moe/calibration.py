"""Calibration statistics for static activation scales: the running max |input| of modules, recorded by
forward pre-hooks while calibration text runs through a model.

Hooks are attached module by module (`attach`), so the statistics do not depend on running the whole model
at once: any subset of layers, fed its inputs, records the same values. An `nn.Linear` records one scalar;
an `ExpertBank` records, per expert, the amax of the tokens routed to it (its up projection's input) and
of `relu2(x_e @ up_e.T)` (its down projection's input).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moe.experts import ExpertBank
from moe.quant.kernels.experts import relu2


class InputAmax:
    """Input amax per module name.

    linear: {name: fp32 scalar}. experts: {name: (up [E], down [E]) fp32}.
    """

    def __init__(self):
        self.linear: dict[str, torch.Tensor] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def attach(self, name: str, module: nn.Module) -> RemovableHandle:
        """Record the inputs of `module` (an `nn.Linear` or an `ExpertBank`) under `name` on every forward.

        Raises:
            TypeError: another kind of module.
        """
        if isinstance(module, nn.Linear):
            return module.register_forward_pre_hook(lambda m, args: self._linear(name, args[0]))
        if isinstance(module, ExpertBank):
            E = module.n_experts
            self.experts.setdefault(name, (torch.zeros(E), torch.zeros(E)))
            return module.register_forward_pre_hook(lambda m, args: self._bank(name, m, *args))
        raise TypeError(f"{name}: cannot calibrate a {type(module).__name__} (an nn.Linear or an ExpertBank)")

    @torch.no_grad()
    def _linear(self, name: str, x: torch.Tensor) -> None:
        a = x.detach().abs().amax().float().cpu()
        self.linear[name] = torch.maximum(self.linear.get(name, a), a)

    @torch.no_grad()
    def _bank(self, name: str, bank: ExpertBank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
        up, down = self.experts[name]
        for e in ids.reshape(-1).unique().tolist():
            xe = x[(ids == e).any(dim=-1)]
            up[e] = torch.maximum(up[e], xe.abs().amax().float().cpu())
            down[e] = torch.maximum(down[e], relu2(xe @ bank.weights_of(e)[0].T).abs().amax().float().cpu())

    def fill_unreached(self) -> None:
        """Experts no calibration token reached get the largest amax of their bank (as ModelOpt's export does
        for uncalibrated experts)."""
        for up, down in self.experts.values():
            up[up == 0] = up.max()
            down[down == 0] = down.max()
