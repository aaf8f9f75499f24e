"""NVFP4: E2M1 codes in blocks of 16 along the input dimension, an E4M3 scale per block, an fp32 global scale
(the functions and the `NVFP4` codec).

On disk (NVIDIA ModelOpt `quant_algo: NVFP4`; vLLM `ModelOptNvFp4LinearMethod`), for a weight [out, in]:

    weight          uint8 [out, in/2]          two E2M1 codes per byte, element 2j in the low nibble
    weight_scale    float8_e4m3fn [out, in/16]  row-major (the 128x4 swizzle of the GPU kernels is a
                                                load-time layout, never stored)
    weight_scale_2  fp32 []                     global scale, a **multiplier**

    W[r, c] = E2M1[code(r, c)] * (float(weight_scale[r, c // 16]) * weight_scale_2)

compressed-tensors (`nvfp4-pack-quantized`) stores the same codes and block scales (`weight_packed`,
`weight_scale`) but its global scale `weight_global_scale` is a **divisor**, 1 / weight_scale_2:

    W[r, c] = E2M1[code(r, c)] * (float(weight_scale[r, c // 16]) / weight_global_scale)

(docs/cases.md case 13, tests/test_quant_oracles.py: using one as the other is off by a factor of global_scale^2.)

Quantization. ModelOpt (`NVFP4QTensor.quantize`):
    weight_scale_2 = amax|W| / (6 * 448)
    s_b  = e4m3(clamp(amax_b / (6 * weight_scale_2), 2^-9, 448))       (all-zero block: 1.0)
    code = RNE_E2M1(W / (float(s_b) * weight_scale_2))
compressed-tensors (`generate_gparam`, `calculate_qparams`, `quantize`):
    global = 6 * 448 / amax|W|
    s_b  = e4m3(clamp(amax_b / 6 * global, -448, 448))                  (zero scale: 0.125)
    code = RNE_E2M1(clamp(W / (float(s_b) / global), -6, 6))
Both compute in fp32. The two differ only in float rounding of the scale arithmetic; `convention`
picks which one to reproduce bit for bit. NaN weights are ignored by the global amax, so only the block
holding one decodes to NaN (its block scale is the E4M3 NaN).
"""

from __future__ import annotations

import torch

from moe.quant.codec import Codec, Layout, by_row_slices
from moe.quant.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from moe.quant.e4m3 import E4M3_MAX, E4M3_MIN_SUBNORMAL, decode_e4m3, encode_e4m3

GROUP = 16
CONVENTIONS = ("modelopt", "compressed-tensors")


def _blocks(w: torch.Tensor, group: int) -> torch.Tensor:
    if w.shape[-1] % group:
        raise ValueError(f"the input dimension {w.shape[-1]} is not a multiple of the block size {group}")
    return w.unflatten(-1, (-1, group))


def _tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """amax over the last two dims (per matrix; leading dims kept), NaN ignored, as fp32."""
    return w.detach().float().abs().nan_to_num(nan=0.0).amax(dim=(-2, -1))


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, convention: str = "modelopt", group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] -> (packed uint8 [..., out, in/2], block scales float8_e4m3fn [..., out, in/16],
    global scale fp32 [...]).

    The global scale is returned in the convention's own form: the multiplier `weight_scale_2` for
    "modelopt", the divisor `weight_global_scale` for "compressed-tensors". Pass `global_scale` (same
    form) to reuse a given one (e.g. shared by fused projections).
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown NVFP4 convention {convention!r}; expected one of {CONVENTIONS}")
    if global_scale is None:
        global_scale = nvfp4_global_scale(w, convention)
    packed, scale = by_row_slices(lambda rows: _quantize_blocks(rows, global_scale, convention, group), w)
    return packed, scale, global_scale.float()


def nvfp4_global_scale(w: torch.Tensor, convention: str = "modelopt") -> torch.Tensor:
    """The global scale of weight [..., out, in] (fp32 [...]): ModelOpt's multiplier `weight_scale_2`
    amax / (6 * 448), or compressed-tensors' divisor 6 * 448 / amax (1.0 where that is not finite)."""
    if convention == "modelopt":
        return _tensor_amax(w) / (E2M1_MAX * E4M3_MAX)
    amax = _tensor_amax(w).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)


def _quantize_blocks(w: torch.Tensor, global_scale: torch.Tensor, convention: str, group: int):
    """(packed codes, block scales) of rows `w` under the given global scale (each row on its own)."""
    x = _blocks(w.detach().float(), group)  # [..., out, in/g, g]
    block_amax = x.abs().amax(dim=-1)  # NaN propagates: a block holding NaN gets a NaN scale
    lead = (...,) + (None,) * 2
    g = global_scale.float()
    if convention == "modelopt":  # g multiplies
        s = block_amax / (E2M1_MAX * g[lead])
        s = torch.where(s == 0, torch.ones_like(s), s)
        scale = s.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
        step = scale.float() * g[lead]
    else:  # g divides
        s = block_amax / E2M1_MAX * g[lead]
        scale = encode_e4m3(s)
        scale = torch.where(scale.float() == 0, torch.full_like(scale, 0.125), scale)
        step = scale.float() / g[lead]
    codes = encode_e2m1((x / step[..., None]).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2))
    return pack_nibbles(codes), scale


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, divisor: bool = False, group: int = GROUP
) -> torch.Tensor:
    """(packed uint8 [..., out, in/2], scale e4m3 [..., out, in/g], global fp32 [...]) -> float32 [..., out, in].

    `divisor=False`: ModelOpt's `weight_scale_2` (multiply); `True`: compressed-tensors' global scale (divide).
    """
    values = decode_e2m1(unpack_nibbles(packed)).unflatten(-1, (-1, group))
    g = global_scale.float()[(...,) + (None,) * 2]
    step = decode_e4m3(scale) / g if divisor else decode_e4m3(scale) * g
    return (values * step[..., None]).flatten(-2)


class NVFP4Codec(Codec):
    """E2M1 codes in blocks of 16 with E4M3 block scales and an fp32 global scale, a multiplier (ModelOpt) or
    a divisor (compressed-tensors, `layout.divisor`); optionally the activations' global scale."""

    name = "nvfp4"
    group = GROUP

    def roles(self, layout: Layout) -> tuple[str, ...]:
        return ("data", "scale", "global") + (("input",) if layout.input_scale else ())

    def specs(self, layout, out_features, in_features):
        return {"data": ((out_features, in_features // 2), torch.uint8),
                "scale": ((out_features, in_features // self.group), torch.float8_e4m3fn),
                "global": (layout.scalar_shape, torch.float32)}

    def units(self, layout):
        return {"data": (1, 2), "scale": (1, self.group)}

    def quantize(self, w, layout):
        convention = "compressed-tensors" if layout.divisor else "modelopt"
        packed, scale, g = quantize_nvfp4(w, convention=convention, group=self.group)
        return {"data": packed, "scale": scale, "global": g}

    def dequantize(self, t, layout):
        data = t["data"]
        g = t["global"].reshape(data.shape[:-2])
        return dequantize_nvfp4(data, t["scale"], g, divisor=layout.divisor, group=self.group)

    def input_scale(self, amax, layout):
        """ModelOpt: amax / (6 * 448), a multiplier (compressed-tensors' divisor is its inverse); an amax of 0
        (never seen) gives 1.0."""
        scale = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
        return 1.0 / scale if layout.divisor else scale

    def fake_quantize(self, x, layout, input_scale):
        """Dynamic E4M3 scales per 16-block under the activation global scale, as for weights (ModelOpt
        convention; compressed-tensors' `input_global_scale` is the divisor 1/g)."""
        g = None if input_scale is None else input_scale.float().reshape(())
        convention = "compressed-tensors" if layout.divisor else "modelopt"
        flat = x.reshape(-1, x.shape[-1])
        packed, scale, g = quantize_nvfp4(flat, g, convention, self.group)
        return dequantize_nvfp4(packed, scale, g, divisor=layout.divisor, group=self.group).reshape(x.shape)

    def weight_args(self, layout):
        return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group}


NVFP4 = NVFP4Codec()
