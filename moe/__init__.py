"""Model-agnostic Mixture-of-Experts: router maths, every expert-bank implementation, token dispatch.

    router.py       route, TopkRouter (sigmoid scores, bias-corrected grouped top-k)
    experts.py      relu2, dispatch, ExpertBank (float), QuantExpertBank (packed), PrepackedExpertBank (bf16, CPU)
    prepack.py      prepack / unpack a model's bf16 weights for the CPU kernels
    calibration.py  InputAmax: input statistics for static activation scales, by forward hooks
    quant/          weight formats and packed Linear modules (imports nothing else of `moe`)

Nothing here imports `hybrid`. The names below are imported on first use (PEP 562), so that importing
`moe.quant` alone loads nothing of `moe` outside it.
"""

from importlib import import_module

_EXPORTS = {
    "ExpertBank": "moe.experts", "InputAmax": "moe.calibration", "PrepackedExpertBank": "moe.experts",
    "QuantExpertBank": "moe.experts", "TopkRouter": "moe.router", "dispatch": "moe.experts",
    "prepack": "moe.prepack", "relu2": "moe.experts", "route": "moe.router", "unpack": "moe.prepack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
