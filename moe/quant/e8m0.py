"""E8M0: the shared power-of-two scale of the OCP microscaling (MX) formats, one byte per block.

Layout (OCP Microscaling Formats (MX) v1.0, section 5.4.1): an unsigned 8-bit biased exponent, bias 127,
no sign and no mantissa; value = 2^(e - 127) for e in 0..254 (2^-127 .. 2^127); 0xFF is NaN.
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF


def decode_e8m0(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8, any shape) -> float32 scales 2^(e-127); 0xFF -> NaN."""
    if bits.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales are uint8 bytes, got {bits.dtype}")
    value = torch.exp2(bits.float() - E8M0_BIAS)
    return torch.where(bits == E8M0_NAN, torch.full_like(value, float("nan")), value)


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents (any numeric dtype) -> E8M0 bytes, clamped to 2^-127..2^127 (+-Inf too);
    NaN -> 0xFF. A fractional exponent rounds down (floor)."""
    e = exponent.double().floor()  # float64: exact for every int32 and float32 exponent, and for float64's floor
    out = (e.nan_to_num(0.0).clamp(-E8M0_BIAS, 254 - E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isnan(e), torch.full_like(out, E8M0_NAN), out)
