"""Model-agnostic Mixture-of-Experts: router maths, every expert-bank implementation, token dispatch.

    router.py       TopkRouter (sigmoid scores, bias-corrected grouped top-k)
    experts.py      ExpertBank (float), QuantExpertBank (packed)
    prepack.py      prepack / unpack a model's bf16 weights for the CPU kernels (PrepackedExpertBank, ...)
    calibration.py  InputAmax: input statistics for static activation scales, by forward hooks
    quant/          weight formats and packed Linear modules (imports nothing else of `moe`); its kernels/
                    are the MoE's kernel seam: `route` and `dispatch` (the references) and the operations
                    that pick a kernel beside them

Nothing here imports `hybrid`. The names below are imported on first use (PEP 562), so that importing
`moe.quant` alone loads nothing of `moe` outside it.
"""

from importlib import import_module

_EXPORTS = {
    "ExpertBank": "moe.experts", "InputAmax": "moe.calibration", "PrepackedExpertBank": "moe.quant.kernels.prepacked",
    "QuantExpertBank": "moe.experts", "TopkRouter": "moe.router", "dispatch": "moe.quant.kernels.experts",
    "prepack": "moe.prepack", "relu2": "moe.quant.kernels.experts", "route": "moe.quant.kernels.routing",
    "unpack": "moe.prepack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
