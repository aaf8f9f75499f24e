"""FP8 E4M3 weights with per-tensor, per-channel or 128x128 block scales: the functions and the `FP8` codec.

    W[r, c] ~= e4m3(q[r, c]) * scale[...]          scale fp32, one of
        per-tensor    scale []                      ModelOpt `quant_algo: FP8`, compressed-tensors `tensor`
        per-channel   scale [out]                   ModelOpt `FP8_PER_CHANNEL_PER_TOKEN`, c-t `channel`
        block         scale [ceil(out/B), ceil(in/B)], B = 128 (DeepSeek-V3 style; ModelOpt `FP8_PB_WO`,
                      compressed-tensors `block` / `FP8_BLOCK`); scale[r // B, c // B]

Quantize (ModelOpt `FP8QTensor.quantize`, compressed-tensors `float-quantized`): `scale = amax / 448`
over the tensor, row or block (an all-zero one gets 1.0), then `q = e4m3(W / scale)` computed in fp32.
The weight is an `[..., out, in]` tensor; leading dimensions (stacked experts) get their own scales.
"""

from __future__ import annotations

import torch

from moe.quant.codec import Codec, Layout
from moe.quant.e4m3 import E4M3_MAX, decode_e4m3, encode_e4m3

GRANULARITIES = ("tensor", "channel", "block")
BLOCK = 128


def fp8_scale_shape(out_features: int, in_features: int, granularity: str, block: int = BLOCK) -> tuple[int, ...]:
    """The shape of `weight_scale` for one `[out, in]` weight."""
    if granularity == "tensor":
        return ()
    if granularity == "channel":
        return (out_features,)
    if granularity == "block":
        return (-(-out_features // block), -(-in_features // block))
    raise ValueError(f"unknown FP8 scale granularity {granularity!r}; expected one of {GRANULARITIES}")


def _expand(scale: torch.Tensor, shape: torch.Size, granularity: str, block: int) -> torch.Tensor:
    """Broadcast `scale` (leading dims + the granularity's shape) against a weight of `shape`."""
    if granularity == "tensor":
        return scale[..., None, None]
    if granularity == "channel":
        return scale[..., :, None]
    rows, cols = shape[-2], shape[-1]
    return scale.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]


def _amax(w: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    a = w.detach().abs().float()
    if granularity == "tensor":
        return a.amax(dim=(-2, -1))
    if granularity == "channel":
        return a.amax(dim=-1)
    rows, cols = a.shape[-2], a.shape[-1]
    pr, pc = -rows % block, -cols % block
    a = torch.nn.functional.pad(a, (0, pc, 0, pr))  # zeros never raise a block's amax
    a = a.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # [..., R, B, C, B]
    return a.amax(dim=(-3, -1))


def quantize_fp8(w: torch.Tensor, granularity: str = "tensor", block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] (any float dtype) -> (q float8_e4m3fn [..., out, in], scale fp32).

    The scale has the leading dims of `w` followed by `fp8_scale_shape(out, in, granularity)`.
    """
    fp8_scale_shape(1, 1, granularity)  # validates the name
    amax = _amax(w, granularity, block)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = encode_e4m3(w.float() / _expand(scale, w.shape, granularity, block))
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, granularity: str = "tensor", block: int = BLOCK) -> torch.Tensor:
    """(q float8_e4m3fn [..., out, in], scale fp32) -> float32 weight `e4m3(q) * scale`."""
    return decode_e4m3(q) * _expand(scale.float(), q.shape, granularity, block)


class FP8Codec(Codec):
    """E4M3 elements; an fp32 scale per tensor, channel or block (`layout.granularity`, `layout.block`);
    optionally a static fp32 input scale (`amax / 448`)."""

    name = "fp8"
    granularities = GRANULARITIES

    def label(self, layout: Layout) -> str:
        return "FP8" if layout.granularity == "tensor" else f"FP8-{layout.granularity}"

    def specs(self, layout, out_features, in_features):
        scale = fp8_scale_shape(out_features, in_features, layout.granularity, layout.block)
        if scale == ():
            scale = layout.scalar_shape
        elif layout.granularity == "channel" and layout.scalar_shape == (1,):  # compressed-tensors keeps [out, 1]
            scale = (out_features, 1)
        return {"data": ((out_features, in_features), torch.float8_e4m3fn), "scale": (scale, torch.float32)}

    def units(self, layout):
        scale = {"tensor": (None, None), "channel": (1, None), "block": (layout.block, layout.block)}
        return {"data": (1, 1), "scale": scale[layout.granularity]}

    def quantize(self, w, layout):
        q, scale = quantize_fp8(w, layout.granularity, layout.block)
        return {"data": q, "scale": scale}

    def dequantize(self, t, layout):
        data, scale = t["data"], t["scale"]
        if layout.granularity == "tensor":
            scale = scale.reshape(data.shape[:-2])
        elif layout.granularity == "channel":
            scale = scale.reshape(data.shape[:-1])
        return dequantize_fp8(data, scale, layout.granularity, layout.block)

    def input_scale(self, amax, layout):
        """ModelOpt `get_activation_scaling_factor`: amax / 448; an amax of 0 (never seen) gives 1.0."""
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))

    def fake_quantize(self, x, layout, input_scale):
        """With a static `input_scale` s: x -> e4m3(x / s) * s (vLLM `kFp8StaticTensorSym`); without one,
        dynamic per token, s = amax_token / 448."""
        if input_scale is not None:
            s = input_scale.float().reshape(())
        else:
            amax = x.abs().amax(dim=-1, keepdim=True)
            s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        return decode_e4m3(encode_e4m3(x / s)) * s

    def weight_args(self, layout):
        args = {"dynamic": False, "num_bits": 8, "type": "float"}
        if layout.granularity != "tensor":
            args["strategy"] = layout.granularity
        return args


FP8 = FP8Codec()
