"""Activation quantization, emulated: quantize-dequantize the input of a quantized matmul (W8A8 / W4A4).

Weight-only compute (W8A16 / W4A16: activations stay in the model dtype) is the default of the packed
modules; this is the option that reproduces what an FP8 or FP4 tensor-core GEMM sees.

    FP8 with a static `input_scale` s:    x -> e4m3(x / s) * s                 (vLLM `kFp8StaticTensorSym`)
    FP8 without one (per-channel/block):  dynamic per token, s = amax_token / 448
    NVFP4 with the activation global scale g: per 16-block dynamic E4M3 scales under g, as for weights
                                          (ModelOpt convention; compressed-tensors' `input_global_scale`
                                          is the divisor 1/g)
    MXFP4:                                dynamic per 32-block E8M0 scales
"""

from __future__ import annotations

import torch

from moe.quant import mxfp4, nvfp4
from moe.quant.e4m3 import E4M3_MAX, decode_e4m3, encode_e4m3
from moe.quant.format import QuantFormat


def fake_quantize_input(x: torch.Tensor, fmt: QuantFormat, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> x after a quantize-dequantize round trip in `fmt`'s activation format (x's dtype).

    `input_scale` is the stored static scale (a 0-dim / 1-element fp32 tensor), or None.
    """
    xf = x.float()
    if fmt.kind == "fp8":
        if input_scale is not None:
            s = input_scale.float().reshape(())
        else:
            amax = xf.abs().amax(dim=-1, keepdim=True)
            s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        out = decode_e4m3(encode_e4m3(xf / s)) * s
    elif fmt.kind == "nvfp4":
        g = None if input_scale is None else input_scale.float().reshape(())
        flat = xf.reshape(-1, xf.shape[-1])
        conv = "compressed-tensors" if fmt.divisor else "modelopt"
        packed, scale, g = nvfp4.quantize_nvfp4(flat, g, conv, fmt.group)
        out = nvfp4.dequantize_nvfp4(packed, scale, g, divisor=fmt.divisor, group=fmt.group).reshape(xf.shape)
    else:
        flat = xf.reshape(-1, xf.shape[-1])
        packed, scales = mxfp4.quantize_mxfp4(flat, group=fmt.group)
        out = mxfp4.dequantize_mxfp4(packed, scales, group=fmt.group).reshape(xf.shape)
    return out.to(x.dtype)
