"""Prepack a model's bf16 weights for the CPU's bf16 kernels (inference), and back.

`prepack(model)` swaps, in place, every bf16 `nn.Linear` for a `moe.quant.kernels.prepacked.PrepackedLinear` and
every bf16 `moe.experts.ExpertBank` for a `moe.quant.kernels.prepacked.PrepackedExpertBank` (decode matrix-vector products faster
than eager `F.linear` on an AVX-512-BF16 CPU: docs/perf-log.md#bf16-decode-kernel; `moe.quant.kernels.bf16`).
`unpack(model)` swaps them back (what quantizing or training needs).
"""

from __future__ import annotations

import torch
from torch import nn

from moe.experts import ExpertBank
from moe.quant.kernels import backend, bf16
from moe.quant.kernels.prepacked import Prepacked, PrepackedExpertBank, PrepackedLinear
from moe.quant.swap import swap_modules


def prepackable(model: nn.Module, device: str | torch.device | None = None) -> dict[str, nn.Module]:
    """{name: module} of the bf16 `nn.Linear`s and `ExpertBank`s of `model` that `prepack` would swap: in
    bf16, on the CPU (or meant for it: `device`, for a model still on the meta device), and not sharing their
    weight with another module (a head tied to the embeddings stays dense: one copy). Quantized modules and
    other dtypes (fp32 routers, fp32 models) are not."""
    shared = {id(p) for m in model.modules() if not isinstance(m, (nn.Linear, ExpertBank))
              for p in m.parameters(recurse=False)}

    def eligible(weight: torch.Tensor) -> bool:
        on = device if device is not None else weight.device
        return weight.dtype == torch.bfloat16 and backend.cpu_kernels_on(on) and id(weight) not in shared

    return {name: m for name, m in model.named_modules()
            if (type(m) is nn.Linear and eligible(m.weight)) or (type(m) is ExpertBank and eligible(m.up_proj))}


def prepack(model: nn.Module) -> int:
    """Swap the modules `prepackable(model)` names for prepacked ones, in place, and freeze every parameter
    (a backward pass raises instead of silently leaving the packed weights without gradients). Returns the
    number of modules swapped.

    Raises:
        RuntimeError: this CPU or PyTorch build has no bf16 kernels (check `moe.quant.kernels.bf16.available()`).
    """
    if not bf16.available():
        raise RuntimeError("no bf16 kernels (neither this project's nor oneDNN's) on this CPU / PyTorch build")
    eligible = prepackable(model)

    def packed(name: str, child: nn.Module) -> nn.Module | None:
        if name not in eligible:
            return None
        return PrepackedLinear(child) if isinstance(child, nn.Linear) else PrepackedExpertBank(child)

    swapped = swap_modules(model, packed)
    model.requires_grad_(False)
    return swapped


def unpack(model: nn.Module) -> int:
    """Swap every prepacked module of `model` back to the plain module with dense weights, in place, and make
    its parameters trainable again, as after a plain load. Returns the number of modules swapped."""
    swapped = swap_modules(model, lambda name, child: plain(child) if isinstance(child, Prepacked) else None)
    if swapped:
        model.requires_grad_(True)
    return swapped


def plain(module: Prepacked) -> nn.Module:
    """The plain module (`nn.Linear` or `ExpertBank`) with the weights of prepacked `module` (dense copies).

    Raises:
        TypeError: `module` is neither a `PrepackedLinear` nor a `PrepackedExpertBank`.
    """
    with torch.device("meta"):  # built empty, then given the dense weights
        if isinstance(module, PrepackedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        elif isinstance(module, PrepackedExpertBank):
            bank = ExpertBank(module.n_experts, module.shapes["up_proj"][2], module.shapes["up_proj"][1])
        else:
            raise TypeError(f"{type(module).__name__}: expected a PrepackedLinear or a PrepackedExpertBank")
    if isinstance(module, PrepackedLinear):
        linear.weight, linear.bias = nn.Parameter(module.weight), module.bias
        return linear
    bank.up_proj, bank.down_proj = nn.Parameter(module.up_proj), nn.Parameter(module.down_proj)
    return bank
