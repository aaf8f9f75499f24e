"""The element and scale encodings against hand tables and float64 oracles (OCP OFP8 v1.0, OCP MX v1.0)."""

import math

import pytest
import torch

from moe.quant.e2m1 import E2M1_VALUES, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from moe.quant.e4m3 import decode_e4m3, encode_e4m3
from moe.quant.e8m0 import decode_e8m0, encode_e8m0
from moe.quant.mxfp4 import dequantize_mxfp4, mxfp4_exponents, quantize_mxfp4
from moe.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

# Hand table of the 16 E2M1 codes (OCP MX v1.0 table 5): sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_HAND = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0}


def test_all_16_e2m1_codes_decode_to_the_spec_values():
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    for code in range(16):
        want = (-1.0 if code & 8 else 1.0) * E2M1_HAND[code & 7]
        assert got[code].item() == want and math.copysign(1, got[code].item()) == math.copysign(1, want), code
    assert E2M1_VALUES[8] == 0.0 and math.copysign(1, E2M1_VALUES[8]) == -1.0  # code 8 is -0


def _e4m3_by_hand(bits: int) -> float:
    s, e, m = bits >> 7, (bits >> 3) & 15, bits & 7
    if e == 15 and m == 7:
        return math.nan
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def test_all_256_e4m3_bit_patterns_decode_to_the_spec_values():
    got = decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    torch_view = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    for b in range(256):
        want = _e4m3_by_hand(b)
        if math.isnan(want):
            assert math.isnan(got[b]) and b in (0x7F, 0xFF)
            continue
        assert got[b].item() == want and math.copysign(1, got[b].item()) == math.copysign(1, want), hex(b)
        assert torch_view[b].item() == want
    assert got[0x7E].item() == 448.0 and got[0x01].item() == 2.0**-9  # max normal, min subnormal


def _nearest_even(x: float, values: list[tuple[float, int]]) -> int:
    """float64 oracle: the code of the nearest value, ties to the even code (mantissa bit 0 clear)."""
    best = min(abs(x - v) for v, _ in values)
    ties = [c for v, c in values if abs(x - v) == best]
    return min(ties, key=lambda c: (c & 1, c))


def test_e2m1_encode_rounds_to_nearest_even_and_saturates():
    positives = [(E2M1_HAND[c], c) for c in range(8)]
    grid = [v for v, _ in positives]
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    xs = sorted(set(grid + midpoints + [m * (1 + s) for m in midpoints for s in (-1e-6, 1e-6)] + [0.1, 0.3, 5.9]))
    codes = encode_e2m1(torch.tensor(xs, dtype=torch.float64))
    for x, c in zip(xs, codes.tolist()):
        assert c == _nearest_even(x, positives), x
    assert encode_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [0, 2, 2, 4, 4, 6, 6]
    # saturation at +-6, signs, -0, NaN (no E2M1 NaN: saturates with its sign)
    special = torch.tensor([6.5, 1e9, math.inf, -7.0, -math.inf, -0.0, 0.0, -0.1, math.nan])
    assert encode_e2m1(special).tolist() == [7, 7, 7, 15, 15, 8, 0, 8, 7]


def test_e4m3_encode_rounds_to_nearest_even_saturates_and_keeps_nan():
    finite = [(_e4m3_by_hand(b), b) for b in range(0x7F)]  # 0 .. 448, codes 0x00 .. 0x7E
    vals = [v for v, _ in finite]
    xs = []
    for a, b in zip(vals, vals[1:]):
        m = (a + b) / 2
        xs += [m, math.nextafter(m, 0), math.nextafter(m, math.inf)]
    xs += [2.0**-10, 2.0**-10 * 1.0001, 3 * 2.0**-10, 2.0**-11]  # subnormal region, ties and below
    got = encode_e4m3(torch.tensor(xs, dtype=torch.float64)).view(torch.uint8).tolist()
    for x, b in zip(xs, got):  # float64 input is rounded once, to its own nearest value (not through fp32)
        assert b == _nearest_even(x, finite), (x, hex(b))
    sat = encode_e4m3(torch.tensor([449.0, 464.0, 465.0, 1e30, math.inf, -math.inf, -500.0])).float().tolist()
    assert sat == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    bits = encode_e4m3(torch.tensor([math.nan, -0.0, 0.0])).view(torch.uint8).tolist()
    assert bits[0] in (0x7F, 0xFF) and bits[1] == 0x80 and bits[2] == 0x00


def test_e8m0_decode_and_encode():
    got = decode_e8m0(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[6])
    assert encode_e8m0(torch.tensor([-127.0, 0.0, 127.0, -300.0, 300.0, math.nan])).tolist() == [0, 127, 254, 0, 254, 255]


def test_nibble_order_even_element_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0xA, 0x7, 0x8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0xA1, 0x87]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_nvfp4_by_hand():
    # one row of 16: amax 6 -> global scale 6 / 2688; block scale e4m3(6 / (6 * s2)) = 448
    w = torch.tensor([[6.0, -3.0, 1.5, 0.0] + [0.25] * 12])
    packed, scale, s2 = quantize_nvfp4(w)
    assert s2.item() == pytest.approx(6 / 2688, rel=1e-7) and scale.float().item() == 448.0
    assert unpack_nibbles(packed)[0, :4].tolist() == [7, 13, 3, 0]
    assert torch.equal(dequantize_nvfp4(packed, scale, s2)[0, :3], torch.tensor([6.0, -3.0, 1.5]))
    # an all-zero block gets block scale 1.0 and decodes to zeros; a NaN block decodes to NaN, only itself
    w2 = torch.cat([torch.zeros(1, 16), torch.full((1, 16), 0.5)], dim=1)
    w2[0, 20] = math.nan
    p2, s2b, g2 = quantize_nvfp4(w2)
    assert s2b.float()[0, 0].item() == 1.0 and torch.isnan(s2b.float()[0, 1])
    out = dequantize_nvfp4(p2, s2b, g2)
    assert torch.equal(out[0, :16], torch.zeros(16)) and torch.isnan(out[0, 16:]).all()


def test_mxfp4_scale_rules_and_nan_block():
    amax = torch.tensor([6.0, 7.0, 7.5, 1.0, 0.0])
    # OCP 6.3: floor(log2 amax) - 2; "round": amax rounded to 1 mantissa bit first (7 -> 8)
    assert mxfp4_exponents(amax, "ocp").tolist() == [0.0, 0.0, 0.0, -2.0, -127.0]
    assert mxfp4_exponents(amax, "round").tolist() == [0.0, 1.0, 1.0, -2.0, -127.0]
    w = torch.cat([torch.linspace(-6, 6, 32), torch.full((32,), 0.3)])[None]
    w[0, 40] = math.nan
    packed, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127, 255]]
    out = dequantize_mxfp4(packed, scales)
    assert torch.isnan(out[0, 32:]).all() and out[0, 0].item() == -6.0 and out[0, 31].item() == 6.0


def test_by_row_slices_runs_slices_of_rows_and_concatenates(monkeypatch):
    from moe.quant import codec

    calls = []

    def quantize(rows):
        calls.append(rows.shape[-2])
        return rows * 2, rows[..., :1]

    w = torch.arange(3 * 10 * 4, dtype=torch.float32).reshape(3, 10, 4)
    monkeypatch.setattr(codec, "SLICE_ELEMENTS", 3 * 4 * 4)  # 4 rows of the 3 matrices at a time
    doubled, first = codec.by_row_slices(quantize, w)
    assert calls == [4, 4, 2]
    assert torch.equal(doubled, w * 2) and torch.equal(first, w[..., :1])
    doubled, first = codec.by_row_slices(quantize, w[:, :0])  # no rows: one call, empty outputs
    assert calls[3:] == [0] and doubled.shape == (3, 0, 4) and first.shape == (3, 0, 1)
    assert quantize_mxfp4(torch.zeros(0, 64))[0].shape == (0, 32)


@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors", "mxfp4"])
def test_quantizing_in_row_slices_gives_the_same_bytes_as_at_once(monkeypatch, convention):
    """Large matrices are quantized a slice of rows at a time (bounded temporaries); the global scale comes
    from the whole matrix, so every byte equals quantizing at once: a stack of experts, rows of magnitudes
    1e-3 to 1e2, a NaN weight and an all-zero block."""
    from moe.quant import codec

    w = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 37)[:, None]
    w[1, 5, 3] = float("nan")
    w[2, 7, :32] = 0

    def run():
        if convention == "mxfp4":
            return quantize_mxfp4(w.bfloat16())
        return quantize_nvfp4(w.bfloat16(), convention=convention)

    at_once = run()
    monkeypatch.setattr(codec, "SLICE_ELEMENTS", 3 * 64 * 5)  # 5 rows at a time: 8 slices
    sliced = run()
    assert len(sliced) == len(at_once)
    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 (float8 NaN compares as bytes)
    for a, b in zip(at_once, sliced):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
