"""FP8 E4M3 ("float8_e4m3fn"): the weight element of FP8 checkpoints and the block scale of NVFP4.

Layout (OCP 8-bit Floating Point Specification (OFP8) v1.0, E4M3; NVIDIA's `__nv_fp8_e4m3`): bit 7 sign,
bits 6-3 exponent (bias 7), bits 2-0 mantissa.

    exponent 0         subnormal: (-1)^s * m/8 * 2^-6        (smallest 2^-9)
    exponent 1..15     normal:    (-1)^s * (1 + m/8) * 2^(e-7)
    S.1111.111         NaN (0x7F, 0xFF); there is no Inf, so S.1111.110 = +-448 is the largest value

Encoding rounds to nearest, ties to even, and saturates ("satfinite": |x| > 448 and +-Inf become +-448;
NaN stays NaN), as ModelOpt and compressed-tensors clamp to +-448 before casting.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def e4m3_value(bits: int) -> float:
    """The value of one E4M3 bit pattern (0..255), straight from the OFP8 definition."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0x0F, bits & 0x07
    if exponent == 0x0F and mantissa == 0x07:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """E4M3 tensor (float8_e4m3fn, or its raw bytes as uint8) -> float32 values of the same shape.

    Uses PyTorch's float8_e4m3fn conversion, which is exact (every E4M3 value is an fp32 value; tests check
    all 256 patterns against `e4m3_value`), and needs no index tensor.
    """
    if t.dtype == torch.uint8:
        t = t.view(torch.float8_e4m3fn)
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"decode_e4m3 expects float8_e4m3fn or uint8, got {t.dtype}")
    return t.float()


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Float values (any float dtype and shape) -> float8_e4m3fn: round to nearest even, saturating.

    float64 values are first rounded onto the E4M3 grid in float64: PyTorch converts to float8 through
    float32, and rounding twice misses the nearest value (1.0625 + 2^-40 -> the tie 1.0625 -> 1.0, not 1.125).
    """
    if x.dtype == torch.float64:
        # E4M3 spacing near |x|: 2^(k-3) for 2^k <= |x| < 2^(k+1), k >= -6 (the subnormals share 2^-9)
        k = (torch.frexp(x).exponent - 1).clamp(min=-6)
        step = torch.exp2((k - 3).double())
        x = torch.round(x / step) * step  # ties to even; exact in float64, and the float32 cast below is exact
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
