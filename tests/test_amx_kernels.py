"""The AMX prefill path (`moe.quant.kernels.amx`): prefill-sized products from FP8 / NVFP4 / MXFP4 bytes on the AMX
tiles equal the product with the exactly dequantized weight up to the order of fp32 sums, at Nano's widths; the
register kernels keep what this path does not cover. Runs only on a CPU with AMX (skipped elsewhere: the register
kernels' own tests cover those CPUs).

Oracle and bound as in test_cpu_kernels.py: float64 `x @ W.T`, W the format's exact dequantization; 2e-6 x
(|x| @ |W|.T) per output element.
"""

from __future__ import annotations

import pytest
import torch

from moe.quant import PackedWeight
from moe.quant.config import modelopt_format
from moe.quant.kernels import amx, bf16, cpu
from test_cpu_kernels import FORMATS, assert_exact, quantized

pytestmark = pytest.mark.skipif(cpu.module() is None or amx.module() is None,
                                reason="no AMX here (or the kernels could not be built)")
COVERED = sorted(n for n in FORMATS if n != "fp8-block")


@pytest.mark.parametrize("name", COVERED)
@pytest.mark.parametrize("shape", [(1856, 2688), (2688, 1856), (200, 2688)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_prefill_products_on_amx_equal_the_dequantized_product(name, shape, monkeypatch):
    """Nano's expert projections and a weight of 200 rows (a partial 64-row slab), at MIN_ROWS rows, 100 (a partial
    32-row block) and a 512-row prefill chunk: computed by this path, each exact."""
    out_f, in_f = shape
    fmt = FORMATS[name]
    q = quantized(fmt, out_f, in_f, seed=out_f + in_f)
    W = q.dequantize(torch.float64)
    calls = spy(monkeypatch)
    for rows in (amx.MIN_ROWS, 100, 512):
        x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert_exact(cpu.linear(x, q), x, W)
    assert calls == [1, 1, 1]


def spy(monkeypatch) -> list[int]:
    """The number of products of each call of `amx.linear_group`, recorded."""
    calls, real = [], amx.linear_group

    def recorded(xs, ts, fmt):
        calls.append(len(xs))
        return real(xs, ts, fmt)

    monkeypatch.setattr(amx, "linear_group", recorded)
    return calls


@pytest.mark.parametrize("name", ["fp8-tensor", "nvfp4", "mxfp4"])
def test_a_group_mixing_small_and_prefill_sized_inputs(name, monkeypatch):
    """A prefill chunk's experts: inputs of 1 to 40 rows in one group call; those of at least MIN_ROWS rows go to
    the AMX tiles in one call, the others to the register kernels; every product exact, with its own expert."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    stack = PackedWeight(fmt, 1856, 2688, n_experts=4)
    for key, t in fmt.quantize(torch.randn(4, 1856, 2688, generator=g) * 0.02, torch.full((4,), 3.0)).items():
        getattr(stack, key).copy_(t)
    rows, experts = [1, 40, 3, 16, 17], [0, 1, 2, 3, 1]
    xs = [torch.randn(r, 2688, generator=g).bfloat16() for r in rows]
    calls = spy(monkeypatch)
    for x, e, y in zip(xs, experts, cpu.linear_group(xs, stack, experts)):
        assert_exact(y, x, stack.dequantize(torch.float64, expert=e))
    assert calls == [3]


def test_what_the_path_leaves_to_the_register_kernels(monkeypatch):
    """fp32 inputs (not exact in bf16), FP8 128 x 128 blocks, fewer than MIN_ROWS rows: not this path."""
    x = torch.randn(64, 256)
    assert not amx.applies(x, FORMATS["fp8-tensor"])
    assert amx.applies(x.bfloat16(), FORMATS["fp8-tensor"])
    assert not amx.applies(x.bfloat16(), FORMATS["fp8-block"])
    assert not amx.applies(x[: amx.MIN_ROWS - 1].bfloat16(), FORMATS["nvfp4"])
    monkeypatch.setenv("HYBRID_AMX_KERNELS", "0")
    amx.module.cache_clear()
    try:
        assert amx.module() is None and not amx.applies(x.bfloat16(), FORMATS["nvfp4"])
    finally:
        monkeypatch.delenv("HYBRID_AMX_KERNELS")
        amx.module.cache_clear()


@pytest.mark.parametrize("byte", [0, 1, 255])
def test_an_mxfp4_weight_with_an_extreme_scale_runs_on_the_register_kernels(byte, monkeypatch):
    """E8M0 bytes 0 and 1 make bf16 subnormals (read as 0 by AMX) and 255 is NaN: such a weight is returned
    uncomputed by the AMX extension and computed by the register kernels, exact (its NaN rows NaN)."""
    q = quantized(modelopt_format("MXFP4"), 96, 2688, seed=9)
    with torch.no_grad():
        q.weight_scale.view(torch.uint8)[3, 7] = byte
    W = q.dequantize(torch.float64)
    x = torch.randn(32, 2688, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert amx.linear_group([x], [q.expert(None)], q.fmt) == [None]
    y = cpu.linear(x, q)
    nan = torch.isnan(W).any(dim=1)
    assert torch.equal(torch.isnan(y), nan.expand_as(y))
    assert_exact(y[:, ~nan], x, W[~nan])


def test_e4m3_nan_codes_make_their_rows_nan():
    """A NaN byte (S.1111.111) in an FP8 weight row makes that row's outputs NaN and no other's, as in the
    reference."""
    q = quantized(modelopt_format("FP8"), 70, 256, seed=3)
    with torch.no_grad():
        q.weight.view(torch.uint8)[5, 17] = 0x7F
        q.weight.view(torch.uint8)[66, 255] = 0xFF
    W = q.dequantize(torch.float64)
    x = torch.randn(20, 256).bfloat16()
    y = amx.linear_group([x], [q.expert(None)], q.fmt)[0]
    nan = torch.isnan(W).any(dim=1)
    assert nan.sum() == 2 and torch.equal(torch.isnan(y), nan.expand_as(y))
    assert_exact(y[:, ~nan], x, W[~nan])


@pytest.mark.parametrize("shape", [(1856, 2688), (2688, 1856), (200, 2688)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_weights_on_amx_equal_the_float64_product(shape):
    """bf16 weights (a bf16 model's experts) at Nano's widths and a partial slab, at MIN_ROWS, 100 and 512 rows:
    the weight's rows are the A operand where they lie; each product exact up to the order of the fp32 sums."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f)
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
    for rows in (amx.MIN_ROWS, 100, 512):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        assert amx.applies_bf16(x, w)
        assert_exact(amx.bf16_linear_group([x], [w])[0], x, w.double())


def test_a_bf16_expert_group_sends_its_inputs_of_min_rows_or_more_to_amx(monkeypatch):
    """`bf16.linear_group` over experts of 1 to 40 rows: those of at least amx.MIN_ROWS rows (decode's 8-16 as well
    as prefill's) in one AMX call, the others in one register-kernel call; every output the exact product (ReLU
    applied), in bf16."""
    g = torch.Generator().manual_seed(8)
    ws = [bf16.pack((torch.randn(1856, 2688, generator=g) * 0.02).bfloat16()) for _ in range(4)]
    rows = [1, 40, 3, amx.MIN_ROWS - 1, amx.MIN_ROWS, bf16.DECODE_ROWS + 1, bf16.DECODE_ROWS]
    xs = [torch.randn(r, 2688, generator=g).bfloat16() for r in rows]
    packs = [ws[0], ws[1], ws[2], ws[3], ws[0], ws[3], ws[1]]
    ext = bf16.plain_kernel()
    calls, small, real, real_small = [], [], amx.bf16_linear_group, ext.bf16_linear_group
    monkeypatch.setattr(amx, "bf16_linear_group", lambda a, w: calls.append([x.shape[0] for x in a]) or real(a, w))
    monkeypatch.setattr(ext, "bf16_linear_group",
                        lambda a, w: small.append([x.shape[0] for x in a]) or real_small(a, w))
    for relu in (False, True):
        for x, w, y in zip(xs, packs, bf16.linear_group(xs, packs, relu=relu)):
            ref = x.double() @ w.double().T
            ref = ref.relu() if relu else ref
            bound = 2e-6 * (x.double().abs() @ w.double().abs().T) + ref.abs() * 2.0 ** -8  # + bf16 rounding
            assert y.dtype == torch.bfloat16 and bool(((y.double() - ref).abs() <= bound).all())
    tiled = [40, amx.MIN_ROWS, bf16.DECODE_ROWS + 1, bf16.DECODE_ROWS]
    assert calls == [tiled, tiled] and small == [[1, 3, amx.MIN_ROWS - 1]] * 2


@pytest.mark.parametrize("rows", [amx.MIN_ROWS - 1, amx.MIN_ROWS, bf16.DECODE_ROWS])
def test_a_dense_bf16_projection_of_decode_rows_takes_amx_from_min_rows(rows, monkeypatch):
    """`bf16.linear` (a dense projection: Mamba's in_proj at Nano's width) at 7, 8 and 16 rows (a server's decode
    step): AMX from amx.MIN_ROWS rows, the register kernel below; exact with its bias and ReLU, in bf16."""
    g = torch.Generator().manual_seed(rows)
    w = bf16.pack((torch.randn(10304, 2688, generator=g) * 0.02).bfloat16())
    bias = torch.randn(10304, generator=g).bfloat16()
    x = torch.randn(rows, 2688, generator=g).bfloat16()
    calls, real = [], amx.bf16_linear_group
    monkeypatch.setattr(amx, "bf16_linear_group", lambda xs_, ws_: calls.append(len(xs_)) or real(xs_, ws_))
    y = bf16.linear(x, w, bias, relu=True)
    ref = (x.double() @ w.double().T + bias.double()).relu()
    bound = 2e-6 * (x.double().abs() @ w.double().abs().T + bias.double().abs()) + ref.abs() * 2.0 ** -8
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 10304)
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert calls == ([1] if rows >= amx.MIN_ROWS else [])
