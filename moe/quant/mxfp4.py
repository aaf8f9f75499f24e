"""MXFP4 (OCP microscaling): E2M1 codes in blocks of 32 along the input dimension, one E8M0 scale per block
(the functions and the `MXFP4` codec).

Layout (OCP Microscaling Formats (MX) v1.0, sections 5.3.3 and 6; gpt-oss, compressed-tensors
`mxfp4-pack-quantized`), for a weight [out, in]:

    codes   uint8 [out, in/2]     two E2M1 codes per byte, element 2j in the low nibble (gpt-oss stores the
                                  same bytes as `*_blocks [out, in/32, 16]`)
    scales  uint8 [out, in/32]    E8M0 exponent bytes (`*_scales`), value 2^(e - 127); 0xFF = NaN

    W[r, c] = E2M1[code(r, c)] * 2^(scales[r, c // 32] - 127)        no global scale

Scale choice. OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax_b)) - 2), 2 being E2M1's largest exponent;
elements then round to nearest even and saturate at +-6, so a block's largest values can clip by up to
25%. compressed-tensors and vLLM's reference (`generate_mx_scales`) first round amax_b to E2M1 precision
(one mantissa bit, half up) so that amax_b >= 1.75 * 2^k takes the next exponent; that is the default
here (`scale_rule="round"`), `scale_rule="ocp"` gives the section 6.3 rule. A block holding NaN gets the
NaN scale 0xFF; an all-zero block gets the smallest scale.
"""

from __future__ import annotations

import torch

from moe.quant.codec import Codec, by_row_slices
from moe.quant.e2m1 import decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from moe.quant.e8m0 import E8M0_BIAS, decode_e8m0, encode_e8m0

GROUP = 32
SCALE_RULES = ("round", "ocp")
_E2M1_EMAX = 2  # floor(log2(6))


def mxfp4_exponents(block_amax: torch.Tensor, scale_rule: str = "round") -> torch.Tensor:
    """Unbiased scale exponents (float32) for blocks with the given amax (float32); NaN where amax is NaN."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown MXFP4 scale rule {scale_rule!r}; expected one of {SCALE_RULES}")
    a = block_amax.float()
    if scale_rule == "round":  # round the mantissa to 1 bit, ties up: keep sign+exponent bits after adding half
        bits = a.view(torch.int32)
        a = torch.where(torch.isnan(a), a, ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32))
    e = torch.floor(torch.log2(a)) - _E2M1_EMAX
    return torch.where(a == 0, torch.full_like(e, -E8M0_BIAS), e)


def quantize_mxfp4(w: torch.Tensor, scale_rule: str = "round", group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] -> (packed uint8 [..., out, in/2], E8M0 scales uint8 [..., out, in/32])."""
    if w.shape[-1] % group:
        raise ValueError(f"the input dimension {w.shape[-1]} is not a multiple of the MX block size {group}")

    def blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = rows.detach().float().unflatten(-1, (-1, group))
        scales = encode_e8m0(mxfp4_exponents(x.abs().amax(dim=-1), scale_rule))
        step = decode_e8m0(scales)
        return pack_nibbles(encode_e2m1((x / step[..., None]).flatten(-2))), scales

    return by_row_slices(blocks, w)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(packed uint8 [..., out, in/2], scales uint8 [..., out, in/32]) -> float32 [..., out, in]."""
    values = decode_e2m1(unpack_nibbles(packed)).unflatten(-1, (-1, group))
    return (values * decode_e8m0(scales)[..., None]).flatten(-2)


class MXFP4Codec(Codec):
    """E2M1 codes in blocks of 32 with E8M0 (power-of-two) block scales; no global or input scale. With
    `layout.blocks_layout` the data is gpt-oss' `*_blocks [out, in/32, 16]` (the same bytes)."""

    name = "mxfp4"
    group = GROUP

    def specs(self, layout, out_features, in_features):
        data = (out_features, in_features // self.group, self.group // 2) if layout.blocks_layout else \
            (out_features, in_features // 2)
        return {"data": (data, torch.uint8), "scale": ((out_features, in_features // self.group), torch.uint8)}

    def units(self, layout):
        return {"data": (1, self.group if layout.blocks_layout else 2), "scale": (1, self.group)}

    def quantize(self, w, layout):
        packed, scale = quantize_mxfp4(w, group=self.group)
        return {"data": packed.unflatten(-1, (-1, self.group // 2)) if layout.blocks_layout else packed,
                "scale": scale}

    def dequantize(self, t, layout):
        data = t["data"].flatten(-2) if layout.blocks_layout else t["data"]
        return dequantize_mxfp4(data, t["scale"], group=self.group)

    def fake_quantize(self, x, layout, input_scale):
        """Dynamic E8M0 scales per 32-block."""
        flat = x.reshape(-1, x.shape[-1])
        packed, scales = quantize_mxfp4(flat, group=self.group)
        return dequantize_mxfp4(packed, scales, group=self.group).reshape(x.shape)

    def weight_args(self, layout):
        return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group}


MXFP4 = MXFP4Codec()
