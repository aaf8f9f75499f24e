"""Mixture-of-Experts building blocks: the router, the resident expert bank, the MoE layer, packed weights.

The names below are imported on first use, so that `moe.quant` (which knows no model) can be imported on
its own without pulling in `hybrid` (whose model imports `moe.layer`).
"""

from importlib import import_module

_EXPORTS = {"ExpertBank": "moe.experts", "MoE": "moe.layer", "TopkRouter": "moe.router", "route": "moe.router"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
