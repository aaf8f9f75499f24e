"""The one way modules are swapped in a model: packed modules for quantized loading, quantized ones for
`hybrid quantize`, oneDNN-prepacked ones for CPU inference (and back)."""

from __future__ import annotations

from typing import Callable

from torch import nn


def swap_modules(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Replace, in place, every submodule for which `replacement(dotted name, module)` returns a module.

    Modules are visited one at a time and the list of them is consumed as it goes, so each original is freed
    as soon as its replacement exists (the model never holds both forms of every weight at once).
    Returns the number of modules replaced.
    """
    children = [(parent, name, f"{prefix}.{name}" if prefix else name, child)
                for prefix, parent in model.named_modules() for name, child in parent.named_children()]
    swapped = 0
    while children:
        parent, name, dotted, child = children.pop()
        new = replacement(dotted, child)
        if new is not None:
            setattr(parent, name, new)
            swapped += 1
    return swapped
