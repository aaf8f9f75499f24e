"""Bit-exact packing against the reference implementations: NVIDIA ModelOpt and compressed-tensors.

Both run on the CPU (test dependencies). ModelOpt: `NVFP4QTensor.quantize` / `.dequantize`,
`FP8QTensor.quantize`, `MXFP4QTensor.dequantize`. compressed-tensors: `generate_gparam` and
`calculate_qparams` for the scales, then the registered compressors (`nvfp4-pack-quantized`,
`float-quantized`, `mxfp4-pack-quantized`) for the bytes, and its `dequantize` for the values.
Inputs are random normal weights (no exact zeros, so ModelOpt's +0 for an exact -0.0 never matters).
"""

import pytest
import torch

from moe.quant import fp8, mxfp4, nvfp4

modelopt_qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

NVFP4QTensor, FP8QTensor, MXFP4QTensor = (modelopt_qtensor.NVFP4QTensor, modelopt_qtensor.FP8QTensor,
                                          modelopt_qtensor.MXFP4QTensor)
SHAPES = [(32, 64), (7, 48), (128, 256), (3, 16)]
_CT_FORMATS = {"NVFP4": "nvfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized"}


def _weights(shape, dtype=torch.float32, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def ct_compress(preset: str, w: torch.Tensor) -> tuple[dict, object]:
    """compressed-tensors' own path: its observers' min/max -> calculate_qparams -> its compressor."""
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    sd, gs = {"weight": w}, None
    if args.strategy == "tensor_group":
        gs = generate_gparam(w.amin(), w.amax())
        sd["weight_global_scale"] = gs
    if args.strategy in ("tensor_group", "group"):
        blocks = w.unflatten(-1, (-1, args.group_size))
        mn, mx = blocks.amin(-1), blocks.amax(-1)
    elif args.strategy == "channel":
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        b = 128
        p = torch.nn.functional.pad(w, (0, -w.shape[1] % b, 0, -w.shape[0] % b))
        blocks = p.unflatten(-1, (-1, b)).unflatten(0, (-1, b))
        mn, mx = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        mn, mx = w.amin(), w.amax()
    sd["weight_scale"], sd["weight_zero_point"] = calculate_qparams(mn, mx, args, global_scale=gs)
    compressor = BaseCompressor.load_from_registry(_CT_FORMATS.get(preset, "float-quantized"))
    return compressor.compress(sd, scheme), scheme


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_equals_modelopt(shape, dtype):
    w = _weights(shape, dtype, seed=shape[0])
    q, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    packed, ours_scale, ours_2 = nvfp4.quantize_nvfp4(w)
    assert torch.equal(packed, q._quantized_data)
    assert torch.equal(_bytes(ours_scale), _bytes(scale))
    assert torch.equal(ours_2, scale_2.float())
    theirs = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(nvfp4.dequantize_nvfp4(packed, ours_scale, ours_2), theirs)


def test_nvfp4_stacked_experts_equal_modelopt_per_expert():
    w = _weights((4, 32, 64), seed=3)
    packed, scale, scale_2 = nvfp4.quantize_nvfp4(w)
    assert scale_2.shape == (4,)
    for e in range(4):
        q, s, s2 = NVFP4QTensor.quantize(w[e].clone(), 16)
        assert torch.equal(packed[e], q._quantized_data) and torch.equal(_bytes(scale[e]), _bytes(s))
        assert torch.equal(scale_2[e], s2.float())


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_equals_compressed_tensors_with_its_divisor(shape):
    w = _weights(shape, seed=shape[1])
    out, scheme = ct_compress("NVFP4", w)
    packed, scale, global_scale = nvfp4.quantize_nvfp4(w, convention="compressed-tensors")
    assert torch.equal(packed, out["weight_packed"])
    assert torch.equal(_bytes(scale), _bytes(out["weight_scale"]))
    assert torch.equal(global_scale.reshape(1), out["weight_global_scale"])
    # its dequantization: codes * (block scale / global), the divisor
    codes = BaseCompressor.load_from_registry("nvfp4-pack-quantized")
    dense = codes.decompress(dict(out), scheme)["weight"]  # bf16, as compressed-tensors returns it
    ours = nvfp4.dequantize_nvfp4(packed, scale, global_scale, divisor=True)
    assert torch.equal(ours.to(torch.bfloat16), dense)
    x_q = nvfp4.decode_e2m1(nvfp4.unpack_nibbles(packed))
    fp32 = ct_dequantize(x_q, out["weight_scale"].float(), args=scheme.weights, global_scale=out["weight_global_scale"],
                         dtype=torch.float32)
    assert torch.equal(ours, fp32)


def test_case13_global_scale_conventions_give_the_same_weight():
    """docs/cases.md 13: the same codes and block scales with ModelOpt's multiplier s2 and compressed-tensors'
    divisor 1/s2 dequantize to the same tensor; using one as the other is off by s2^2."""
    w = _weights((16, 64), seed=13)
    packed, scale, s2 = nvfp4.quantize_nvfp4(w, global_scale=torch.tensor(2.0**-12))  # 1/s2 exact
    as_modelopt = nvfp4.dequantize_nvfp4(packed, scale, s2)
    as_ct = nvfp4.dequantize_nvfp4(packed, scale, 1 / s2, divisor=True)
    assert torch.equal(as_modelopt, as_ct)
    swapped = nvfp4.dequantize_nvfp4(packed, scale, 1 / s2)  # the bug: a divisor used as a multiplier
    assert torch.allclose(swapped, as_modelopt * 2.0**24)
    # with a scale whose inverse is not exact, the two differ by at most fp32 rounding
    packed, scale, s2 = nvfp4.quantize_nvfp4(w)
    a = nvfp4.dequantize_nvfp4(packed, scale, s2)
    b = nvfp4.dequantize_nvfp4(packed, scale, 1 / s2, divisor=True)
    assert torch.allclose(a, b, rtol=2e-7, atol=0)
    # the block scales on disk are row-major [out, in/16]: block (r, j) scales w[r, 16j:16j+16]
    assert scale.shape == (16, 4)
    blocks = w.unflatten(-1, (-1, 16)).abs().amax(-1)
    assert torch.equal(scale, (blocks / (6 * s2)).clamp(2**-9, 448).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("shape", [(64, 96), (5, 40), (200, 300)])
def test_fp8_equals_modelopt_and_compressed_tensors(granularity, shape):
    w = _weights(shape, seed=sum(shape))
    q, scale = fp8.quantize_fp8(w, granularity)
    axis = None if granularity == "tensor" else 0
    mq, ms = FP8QTensor.quantize(w, axis=axis)
    assert torch.equal(_bytes(q), _bytes(mq._quantized_data)) and torch.equal(scale, ms.reshape(scale.shape))
    out, _ = ct_compress("FP8" if granularity == "tensor" else "FP8_DYNAMIC", w)
    assert torch.equal(_bytes(q), _bytes(out["weight"])) and torch.equal(scale, out["weight_scale"].reshape(scale.shape))
    theirs = mq.dequantize(dtype=torch.float32, scale=ms)
    assert torch.equal(fp8.dequantize_fp8(q, scale, granularity), theirs)


def test_fp8_block_equals_modelopt_and_compressed_tensors():
    w = _weights((200, 300), seed=7)
    q, scale = fp8.quantize_fp8(w, "block")
    assert scale.shape == (2, 3)
    out, _ = ct_compress("FP8_BLOCK", w)
    assert torch.equal(_bytes(q), _bytes(out["weight"])) and torch.equal(scale, out["weight_scale"])
    w2 = _weights((256, 384), seed=8)  # ModelOpt pads partial blocks with zeros; whole blocks compare directly
    q2, s2 = fp8.quantize_fp8(w2, "block")
    mq, ms = FP8QTensor.quantize(w2, block_sizes={-1: 128, -2: 128})
    assert torch.equal(_bytes(q2), _bytes(mq._quantized_data)) and torch.equal(s2, ms)
    theirs = mq.dequantize(dtype=torch.float32, scale=ms, block_sizes={-1: 128, -2: 128})
    assert torch.equal(fp8.dequantize_fp8(q2, s2, "block"), theirs)


@pytest.mark.parametrize("shape", [(64, 96), (8, 32), (3, 256)])
def test_mxfp4_equals_compressed_tensors_and_decodes_like_modelopt(shape):
    w = _weights(shape, seed=shape[1] + 1)
    packed, scales = mxfp4.quantize_mxfp4(w)
    out, scheme = ct_compress("MXFP4", w)
    assert torch.equal(packed, out["weight_packed"]) and torch.equal(scales, out["weight_scale"])
    dense = BaseCompressor.load_from_registry("mxfp4-pack-quantized").decompress(dict(out), scheme)["weight"]
    ours = mxfp4.dequantize_mxfp4(packed, scales)
    assert torch.equal(ours.to(dense.dtype), dense)
    mq = MXFP4QTensor(w.shape, torch.float32, packed)
    assert torch.equal(mq.dequantize(dtype=torch.float32, scale=scales, block_sizes={-1: 32}), ours)
