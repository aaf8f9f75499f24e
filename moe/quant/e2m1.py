"""FP4 E2M1: the 4-bit element of NVFP4 and MXFP4, its 16 codes, rounding, and two-per-byte packing.

Layout of a code (OCP Microscaling Formats (MX) v1.0, section 5.3.3, "FP4 (E2M1)"): bit 3 sign, bits 2-1
exponent (bias 1), bit 0 mantissa. Exponent 0 is subnormal (0 or 0.5); there is no Inf or NaN encoding.

    code  0..7  :  0, 0.5, 1, 1.5, 2, 3, 4, 6          code 8..15 : -0, -0.5, -1, -1.5, -2, -3, -4, -6

Packing (NVIDIA NVFP4 and the OCP MX checkpoints alike, e.g. ModelOpt `NVFP4QTensor`, compressed-tensors
`pack_fp4_to_uint8`, gpt-oss `*_blocks`): two codes per byte along the last (input) dimension, element
2j in the **low** nibble and element 2j+1 in the high nibble.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_TABLE = torch.tensor(E2M1_VALUES, dtype=torch.float32)

# Round to nearest, ties to even (even = mantissa bit 0): a magnitude's code is the number of these
# thresholds it passes. `>` at a threshold whose lower neighbour is even (0.25 -> 0, 1.25 -> 1, 2.5 -> 2,
# 5 -> 4), `>=` where the upper neighbour is even (0.75 -> 1, 1.75 -> 2, 3.5 -> 4).
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, values 0..15, any shape) -> float32 values of the same shape (-0 stays -0)."""
    return _TABLE.to(codes.device)[codes.int()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float values (any float dtype and shape) -> E2M1 codes, uint8 of the same shape.

    Rounds to nearest with ties to even, saturates to +-6 (|x| > 6 and +-Inf give code 7 / 15), keeps
    the sign of zero (-0.0 and negatives that round to zero give code 8). The format has no NaN: a NaN
    element gets code 7 with its sign bit (block formats mark NaN through the block scale instead:
    an E4M3 NaN scale in NVFP4, E8M0 0xFF in MXFP4).
    """
    a = x.abs()  # compared in x's own dtype, which holds every threshold exactly (float64 cast to fp32 would round)
    a = torch.where(torch.isnan(a), torch.full_like(a, E2M1_MAX), a)
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _STRICT:
        code += (a > t).to(torch.uint8)
    for t in _INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2n] uint8 (0..15) -> bytes [..., n] uint8: element 2j low nibble, 2j+1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of 4-bit codes into bytes")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] uint8 -> codes [..., 2n] uint8 (inverse of `pack_nibbles`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
