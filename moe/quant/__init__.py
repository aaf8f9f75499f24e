"""Packed FP8 / NVFP4 / MXFP4 weights: exact element formats, packed modules, checkpoint quantization configs.

    e2m1.py, e4m3.py, e8m0.py    the element and scale encodings (encode / decode as pure functions)
    fp8.py, nvfp4.py, mxfp4.py   weight quantization and dequantization in each checkpoint format
    format.py                    QuantFormat: a weight's tensors, names, shapes, dtypes; quantize / dequantize
    activations.py               activation quantize-dequantize (W8A8 / W4A4 emulation)
    packed.py, linear.py,        PackedWeight, QuantLinear, QuantExpertBank: modules whose only weights are
    experts.py                   the packed tensors and scales
    config.py                    ModelOpt (hf_quant_config.json, `modelopt`), compressed-tensors and `mxfp4`
                                 quantization configs -> a QuantFormat per module name; writing ModelOpt's
    triton_kernels.py            fused dequantize-matmul kernels for CUDA (FP8, NVFP4, grouped over experts)

Nothing here knows a model: modules are addressed by their dotted names only.
"""

from moe.quant.experts import QuantExpertBank
from moe.quant.format import QuantFormat
from moe.quant.linear import QuantLinear
from moe.quant.packed import PackedWeight

__all__ = ["PackedWeight", "QuantExpertBank", "QuantFormat", "QuantLinear"]
