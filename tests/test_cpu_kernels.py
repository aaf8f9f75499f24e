"""The packed-weight CPU kernels (`moe.quant.kernels.cpu`): products straight from FP8 / NVFP4 / MXFP4 bytes
equal the product with the exactly dequantized weight up to the order of fp32 sums, at Nemotron 3 Nano's
widths, for every format and layout, with fp32 and bf16 inputs; no dequantized weight is ever made.

Oracle: float64 `x @ W.T` with W = the format's exact dequantization (itself checked against ModelOpt and
compressed-tensors in test_quant_oracles.py). Bound: 2e-6 x (|x| @ |W|.T), the size of an fp32 reordering
error, per output element (an error in a decoded value or a scale would be ~1e-2 of it or more).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moe.experts import ExpertBank, QuantExpertBank
from moe.quant.kernels.experts import dispatch, expert_linear, relu2
from moe.quant import PackedWeight, QuantLinear, kernels
from moe.quant.config import modelopt_format
from moe.quant.e4m3 import e4m3_value
from moe.quant.formats import COMPRESSED_TENSORS, GPT_OSS_MXFP4
from moe.quant.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.module() is None, reason="the CPU kernels could not be built here")

FORMATS = {
    "fp8-tensor": modelopt_format("FP8"),
    "fp8-channel-ct": COMPRESSED_TENSORS["float-quantized"].__class__(
        COMPRESSED_TENSORS["float-quantized"].codec,
        COMPRESSED_TENSORS["float-quantized"].layout.__class__(**{**vars(COMPRESSED_TENSORS["float-quantized"].layout),
                                                                  "granularity": "channel"})),
    "fp8-block": modelopt_format("FP8_PB_WO"),
    "nvfp4": modelopt_format("NVFP4"),
    "nvfp4-ct-divisor": COMPRESSED_TENSORS["nvfp4-pack-quantized"],
    "mxfp4": modelopt_format("MXFP4"),
    "mxfp4-gpt-oss-blocks": GPT_OSS_MXFP4,
}
# Nano's expert up and down projections (1,856 = 14.5 x 128: a partial FP8 block in rows or in columns),
# and small odd shapes: N not a multiple of the 4-row tile, K % 32 == 16 (a half FP4 chunk), K % 16 != 0.
SHAPES = [(1856, 2688), (2688, 1856), (7, 48)]


def quantized(fmt, out_f, in_f, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.02)
        lin.weight[0, :5] = 0.0  # zeros and tiny values: E4M3 subnormal codes, E2M1 zeros
        lin.weight[1, :5] = 1e-7
    return QuantLinear.from_linear(lin, fmt, torch.tensor(3.0))


def assert_exact(got: torch.Tensor, x: torch.Tensor, W: torch.Tensor) -> None:
    ref = x.double() @ W.double().T
    bound = 2e-6 * (x.double().abs() @ W.double().abs().T) + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_from_packed_bytes_equals_the_dequantized_product(name, shape):
    out_f, in_f = shape
    fmt = FORMATS[name]
    if fmt.codec.group and in_f % fmt.codec.group:
        pytest.skip(f"{fmt.label} needs in_features in blocks of {fmt.codec.group}")
    q = quantized(fmt, out_f, in_f, seed=out_f + in_f)
    W = q.dequantize(torch.float64)
    for rows in (1, 3, 16):
        x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            assert_exact(cpu.linear(xd, q), xd, W)


NO_BF16_WEIGHTS = "no bf16-weight kernel in this build (AVX-512, or AVX2 + FMA)"


@pytest.mark.skipif(not cpu.module().bf16_weights(), reason=NO_BF16_WEIGHTS)
@pytest.mark.parametrize("shape", [(1856, 2688), (2688, 1856), (7, 100), (7, 120)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_weights_dot_product(shape):
    """The plain bf16 form of the prepacked modules (`moe.quant.kernels.bf16`): exact products, fp32 sums;
    K = 100: a partial 32-element step (AVX2: a partial 8-element one too); K = 120: 96 + one 16-element step
    + 8 left (the AVX-512 widening path's three loops)."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f)
    W = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
    for rows in (1, 3, 16):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        assert_exact(cpu.module().bf16_linear(x, W), x, W.double())


@pytest.mark.skipif(not cpu.module().bf16_weights(), reason=NO_BF16_WEIGHTS)
def test_bf16_weights_in_one_group_call():
    """`bf16_linear_group` (a decoded token's experts in one parallel loop): each product of the group, of any
    shapes (Nano's up and down projections, a partial tile, 1 and 5 rows), equals its own exact product."""
    g = torch.Generator().manual_seed(3)
    shapes = [(1856, 2688, 1), (2688, 1856, 1), (7, 100, 5), (1856, 2688, 1)]
    ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k, _ in shapes]
    xs = [torch.randn(r, k, generator=g).bfloat16() for _, k, r in shapes]
    ys = cpu.module().bf16_linear_group(xs, ws)
    assert [tuple(y.shape) for y in ys] == [(r, n) for n, _, r in shapes]
    for x, w, y in zip(xs, ws, ys):
        assert_exact(y, x, w.double())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_group_of_packed_products_in_one_call(name):
    """`cpu.linear_group` (a decoded token's experts in one call per projection): products of 1 and 3 rows
    (8- and 4-row tiles in one parallel loop) each equal their own exact product."""
    q = quantized(FORMATS[name], 1856, 2688, seed=7)
    W = q.dequantize(torch.float64)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(r, 2688, generator=g).bfloat16() for r in (1, 3, 1)]
    for x, y in zip(xs, cpu.linear_group(xs, q, [None] * len(xs))):
        assert_exact(y, x, W)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_group_whose_experts_share_one_input(name):
    """The k experts a decoded token chose share one x, which the extension lays out once for all of them:
    in a group whose inputs repeat one tensor among others, each product equals its own exact product with
    its own expert of a stack."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(11)
    stack = PackedWeight(fmt, 96, 2688, n_experts=3)
    for key, t in fmt.quantize(torch.randn(3, 96, 2688, generator=g) * 0.02, torch.full((3,), 3.0)).items():
        getattr(stack, key).copy_(t)
    x, other = torch.randn(1, 2688, generator=g).bfloat16(), torch.randn(2, 2688, generator=g).bfloat16()
    experts = [2, 0, 0, 1]
    ys = cpu.linear_group([x, other, x, x], stack, experts)
    for e, inp, y in zip(experts, [x, other, x, x], ys):
        assert_exact(y, inp, stack.dequantize(torch.float64, expert=e))
    if cpu.module().bf16_weights():
        ws = [stack.dequantize(torch.float32, expert=e).bfloat16() for e in range(3)]
        for inp, w, y in zip([x, other, x], ws, cpu.module().bf16_linear_group([x, other, x], ws)):
            assert_exact(y, inp, w.double())


def test_fp8_inputs_not_a_multiple_of_16():
    q = quantized(modelopt_format("FP8"), 9, 100, seed=1)
    x = torch.randn(2, 100)
    assert_exact(cpu.linear(x, q), x, q.dequantize(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_pattern_decodes_exactly(dtype):
    """Row n of the weight holds the E4M3 byte n in all 16 places, scale 1: x = 1/16 reads each value alone
    (exact products and sums): subnormals, both zeros, +-448 and NaN included."""
    q = QuantLinear(modelopt_format("FP8_PER_CHANNEL_PER_TOKEN"), 16, 256)
    with torch.no_grad():
        q.weight.copy_(torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous().view(torch.float8_e4m3fn))
        q.weight_scale.fill_(1.0)
    y = cpu.linear(torch.full((1, 16), 1 / 16, dtype=dtype), q)[0]
    want = torch.tensor([e4m3_value(b) for b in range(256)])
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(y[~torch.isnan(want)], want[~torch.isnan(want)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_every_fp4_scale_byte_decodes_exactly(name, dtype):
    """Row n holds the code for 1.0 everywhere and the scale byte n in its one block: with x = 1 / block the
    output is the scale's value alone: E4M3 (NVFP4) and E8M0 (MXFP4) scales, 2^-127, NaN and zeros included."""
    fmt = FORMATS[name]
    group = fmt.codec.group
    q = QuantLinear(fmt, group, 256)
    with torch.no_grad():
        q.role("data").view(torch.uint8).fill_(0x22)  # E2M1 code 2 = 1.0 in both nibbles
        q.role("scale").view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8)[:, None])
        if q.role("global") is not None:
            q.role("global").fill_(1.0)
    y = cpu.linear(torch.full((1, group), 1 / group, dtype=dtype), q)[0]
    want = q.dequantize(torch.float64)[:, 0]
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(y[~torch.isnan(want)].double(), want[~torch.isnan(want)])


def test_fp8_blocks_narrower_than_a_bf16_chunk():
    """FP8 blocks of 32 cut the 64-element bf16 chunks: bf16 inputs then take the fp32 products."""
    base = FORMATS["fp8-block"]
    fmt = base.__class__(base.codec, base.layout.__class__(**{**vars(base.layout), "block": 32}))
    q = quantized(fmt, 70, 200, seed=6)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 200).to(dtype)
        assert_exact(cpu.linear(x, q), x, q.dequantize(torch.float64))


def random_bank(E: int, H: int, I: int, g: torch.Generator, std: float) -> ExpertBank:
    """An fp32 `ExpertBank` of E experts (hidden H, width I) with normal weights of this std drawn from g."""
    bank = ExpertBank(E, H, I)
    with torch.no_grad():
        bank.up_proj.copy_(torch.randn(E, I, H, generator=g) * std)
        bank.down_proj.copy_(torch.randn(E, H, I, generator=g) * std)
    return bank


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_bank_runs_many_tokens_chosen_experts_in_one_call_per_projection(name, monkeypatch):
    """16 tokens (a decode step of 16 sequences) over 6 packed experts: one `cpu.linear_group` call per
    projection for all the chosen experts, exactly the result of one call per expert (`expert_linear`)."""
    E, I, H = 6, 96, 128
    g = torch.Generator().manual_seed(4)
    bank = random_bank(E, H, I, g, 0.1)
    qbank = QuantExpertBank.from_bank(bank, FORMATS[name], FORMATS[name], torch.ones(E), torch.ones(E))
    x = torch.randn(16, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(16)])
    weights = torch.rand(16, 2, generator=g)
    calls = []
    group = cpu.linear_group
    monkeypatch.setattr(cpu, "linear_group", lambda xs, w, experts, ext=None: calls.append(list(experts)) or group(xs, w, experts, ext))
    with torch.no_grad():
        got = qbank(x, weights, ids)
        n = len(calls)
        each = dispatch(x, weights, ids, E, lambda e, part: expert_linear(
            relu2(expert_linear(part, qbank.up_proj, e)), qbank.down_proj, e))
    chosen = sorted(set(ids.flatten().tolist()))
    assert calls[:n] == [chosen, chosen] and torch.equal(got, each)


def test_the_modules_use_the_kernels_and_never_dequantize(monkeypatch):
    """A QuantLinear and a QuantExpertBank at Nano's widths on a few rows: no `dequantize` call, no allocation
    during the forward reaching a quarter of one dense bf16 weight matrix (the profiler's memory events), and
    the same result as the PyTorch path that dequantizes."""
    E, I, H = 4, 1856, 2688
    g = torch.Generator().manual_seed(0)
    bank = random_bank(E, H, I, g, 0.02)
    fmt = modelopt_format("NVFP4")
    qbank = QuantExpertBank.from_bank(bank, fmt, fmt, torch.ones(E), torch.ones(E))
    qlin = quantized(modelopt_format("FP8"), I, H, seed=2)
    x = torch.randn(3, H, generator=g).bfloat16()
    ids, weights = torch.tensor([[0, 2], [2, 3], [1, 2]]), torch.rand(3, 2, generator=g)
    calls = []
    plain = PackedWeight.dequantize
    monkeypatch.setattr(PackedWeight, "dequantize", lambda self, *a, **k: calls.append(self) or plain(self, *a, **k))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        got_bank, got_lin = qbank(x, weights, ids), qlin(x)
        got_one = qbank(x[:1], weights[:1], ids[:1])  # one token: its experts in one call per projection
    assert calls == [] and got_bank.dtype == got_lin.dtype == got_one.dtype == torch.bfloat16
    biggest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert biggest < I * H * 2 / 4, biggest
    with torch.no_grad():  # fp32, kernels against the PyTorch path
        got_bank, got_lin = qbank(x.float(), weights, ids), qlin(x.float())
        got_one = qbank(x[:1].float(), weights[:1], ids[:1])
        monkeypatch.setattr(kernels, "cpu_for", lambda x, fmt: None)
        want_bank, want_lin = qbank(x.float(), weights, ids), qlin(x.float())
        want_one = qbank(x[:1].float(), weights[:1], ids[:1])
    assert len(calls) > 0
    for got, want in ((got_bank, want_bank), (got_lin, want_lin), (got_one, want_one)):  # fp32 sums in another order
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_prefill_sized_inputs_and_disabled_kernels(monkeypatch):
    fmt = modelopt_format("FP8")
    q = quantized(fmt, 40, 256, seed=4)
    x = torch.randn(2, 300, 256)  # a prefill chunk: 600 rows, still straight from the packed bytes
    assert kernels.cpu_for(x, fmt) is cpu
    got = q(x)
    assert_exact(got.reshape(-1, 40), x.reshape(-1, 256), q.dequantize(torch.float64))
    monkeypatch.setenv("HYBRID_CPU_KERNELS", "0")
    cpu.module.cache_clear()
    try:
        assert cpu.module() is None and kernels.cpu_for(torch.zeros(1, 64), fmt) is None
        q = quantized(fmt, 8, 64, seed=3)
        x = torch.randn(1, 64)
        torch.testing.assert_close(q(x), x @ q.dequantize().T, rtol=0, atol=0)
    finally:
        monkeypatch.delenv("HYBRID_CPU_KERNELS")
        cpu.module.cache_clear()
    assert cpu.module() is not None


def test_the_build_is_keyed_on_the_source_torch_and_cpu():
    names = {cpu.build_name(b"a", "2.13", "avx512f"), cpu.build_name(b"b", "2.13", "avx512f"),
             cpu.build_name(b"a", "2.14", "avx512f"), cpu.build_name(b"a", "2.13", "avx2")}
    assert len(names) == 4 and all(n.startswith("hybrid_packed_") for n in names)
    # the torch of another virtual environment (same version, other headers) is another torch
    key = cpu.torch_key()
    assert key.startswith(torch.__version__) and str(Path(torch.__file__).resolve().parent) in key


AVX2 = all(f in cpu.cpu_flags().split() for f in ("avx2", "fma", "f16c"))


def test_the_compiled_path_matches_the_cpu():
    """`path()` names what -march=native compiled: AVX-512 (with or without the bf16 dot products) where the
    CPU has it, else AVX2 + FMA + F16C where it has those, else the scalar loops."""
    flags = cpu.cpu_flags().split()
    want = ("avx512-bf16" if {"avx512_bf16", "avx512vbmi"} <= set(flags) else "avx512f") if "avx512f" in flags \
        else "avx2-fma" if AVX2 else "scalar"
    assert cpu.module().path() == want
    assert cpu.module().avx512() == want.startswith("avx512")


def portable_builds():
    """The builds a CPU without AVX-512 runs: -mno-avx512f (the AVX2 + FMA path where this CPU has it) and
    the scalar loops (-mno-avx2 as well). On a CPU without AVX-512 the first is the default build itself (not
    compiled twice)."""
    yield "avx2-fma" if AVX2 else "scalar", cpu.module(portable="avx512f" in cpu.cpu_flags().split())
    if AVX2:
        yield "scalar", cpu.build(cpu.SOURCE, "hybrid_packed_scalar", cpu.FLAGS + ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
                                  "the scalar CPU kernels")


def test_the_portable_builds_equal_the_dequantized_product_too():
    """The paths a CPU without AVX-512 runs (compiled here without it), every format, fp32 and bf16, tiles of
    8 x 1 and 4 x 1..4 (1, 3, 5 rows), K = 96 (a partial FP8 step of 64), 100 (not a multiple of 16) and, for
    NVFP4, 112 (a half FP4 step of 32 at the end)."""
    for path, ext in portable_builds():
        assert ext is not None and not ext.avx512() and not ext.bf16_inputs() and ext.path() == path
        for name, fmt in sorted(FORMATS.items()):
            for in_f in (96, 100) if fmt.codec.name == "fp8" else (96, 112) if fmt.codec.group == 16 else (96,):
                q = quantized(fmt, 37, in_f, seed=5)
                for rows in (1, 3, 5):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.randn(rows, in_f).to(dtype)
                        assert_exact(cpu.linear(x, q, ext=ext), x, q.dequantize(torch.float64))
        assert ext.bf16_weights() == (path == "avx2-fma")  # the bf16 plain form: AVX2, as on AVX-512 BF16
        if ext.bf16_weights():
            for in_f, rows in ((96, 1), (100, 3), (37, 5)):
                W, x = (torch.randn(19, in_f) * 0.02).bfloat16(), torch.randn(rows, in_f).bfloat16()
                assert_exact(ext.bf16_linear(x, W), x, W.double())


def exts():
    yield cpu.module()
    for _, ext in portable_builds():
        yield ext


@pytest.mark.parametrize("rows", [1, 256])
def test_every_e4m3_code_in_every_position_decodes_exactly(rows):
    """W[n, k] = the k + n-th of the 254 non-NaN E4M3 bytes (so every code meets every vector lane and every
    16-element step), scale 2^-3 per tensor; x = rows of the identity reads W[n, k] * scale alone (exact),
    in every build (the NaN bytes: test_every_e4m3_pattern_decodes_exactly)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    N = K = 256
    q = QuantLinear(modelopt_format("FP8"), K, N)
    idx = (torch.arange(N)[:, None] + torch.arange(K)[None, :]) % len(codes)
    with torch.no_grad():
        q.weight.copy_(codes[idx].view(torch.float8_e4m3fn))
        q.role("scale").fill_(0.125)
    W = q.dequantize(torch.float64)
    x = torch.eye(K)[:rows] if rows > 1 else torch.eye(K)[77:78]
    for ext in exts():
        y = cpu.linear(x, q, ext=ext)
        assert torch.equal(y.double(), (x.double() @ W.T)), ext.path()


@pytest.mark.parametrize("rows", [1, 5])
def test_an_e4m3_nan_code_anywhere_in_a_row_makes_that_row_nan(rows):
    """A NaN byte (S.1111.111) in a 64-byte step, in a later one, in the 32-byte tail or in the masked end of
    a row of 200 makes that row's outputs NaN (NaN times anything is NaN, as in the reference) and no other
    row's, in every build."""
    N, K = 11, 200
    q = quantized(modelopt_format("FP8"), N, K, seed=3)
    nan_at = {1: 5, 4: 70, 6: 130, 8: 180, 9: 199}  # row: position of its NaN byte
    with torch.no_grad():
        data = q.weight.view(torch.uint8)
        for row, k in nan_at.items():
            data[row, k] = 0x7F if row % 2 else 0xFF
    W = q.dequantize(torch.float64)
    assert set(torch.isnan(W).any(dim=1).nonzero().flatten().tolist()) == set(nan_at)
    x = torch.randn(rows, K)
    for ext in exts():
        y = cpu.linear(x, q, ext=ext)
        assert torch.equal(torch.isnan(y), torch.isnan(W).any(dim=1).expand(rows, N)), ext.path()
        keep = ~torch.isnan(W).any(dim=1)
        assert_exact(y[:, keep], x, W[keep])


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 64])
def test_every_e2m1_code_in_every_position_decodes_exactly(name, rows):
    """W[n, k] = E2M1 code (n + k) % 16 (every code in both nibbles and every lane), rows with scales of both
    signs, subnormal (NVFP4) and extreme (MXFP4) ones; x = rows of the identity reads each weight alone."""
    fmt = FORMATS[name]
    N = K = 64
    q = QuantLinear(fmt, K, N)
    code = (torch.arange(N)[:, None] + torch.arange(K)[None, :]) % 16
    scale_bytes = [0x38, 0x01, 0xB9, 0x7E, 0x00, 0x45] if name == "nvfp4" else [127, 0, 1, 200, 240, 100]
    with torch.no_grad():
        q.role("data").view(torch.uint8).copy_((code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8).view_as(
            q.role("data").view(torch.uint8)))
        sc = q.role("scale").view(torch.uint8)
        sc.copy_(torch.tensor(scale_bytes, dtype=torch.uint8)[torch.arange(sc.numel()) % len(scale_bytes)].view_as(sc))
        if q.role("global") is not None:
            q.role("global").fill_(1.0)
    W = q.dequantize(torch.float64)
    assert not torch.isnan(W).any()
    x = torch.eye(K)[:rows] if rows > 1 else torch.eye(K)[37:38]
    for ext in exts():
        y = cpu.linear(x, q, ext=ext)
        assert torch.equal(y.double(), x.double() @ W.T), ext.path()


def test_a_build_killed_midway_does_not_hang_the_next_start():
    """torch's build lock file (`lock`), left behind by a build killed midway (Ctrl-C in the first compile),
    made every later start wait for it forever; `build` now removes it under an OS lock of its own: a start
    that finds a stale `lock` in the kernel's build directory loads the kernel."""
    import subprocess
    import sys

    from hybrid.ops import cpu as mamba

    built = mamba.module()
    if built is None:
        pytest.skip("the Mamba kernel cannot be built here")
    lock = Path(built.__file__).parent / "lock"
    lock.touch()  # what a killed torch build leaves
    try:
        done = subprocess.run([sys.executable, "-c", "from hybrid.ops import cpu; print(cpu.module() is not None)"],
                              capture_output=True, text=True, timeout=120)
    finally:
        stale = lock.exists()
        lock.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert not stale


def test_a_start_with_a_bare_path_uses_the_built_kernel():
    """`.venv/bin/hybrid` run without the environment activated (or a subprocess given a bare PATH) sees no
    `ninja` of the project's environment: torch then built with another ninja from PATH (a rebuild from scratch
    whenever an older version followed a newer one on the cache directory) or with none (no kernel). `build`
    puts the ninja package's directory first while it builds: the kernel loads, compiled once, not again."""
    import os
    import subprocess
    import sys

    from hybrid.ops import cpu as ops

    built = ops.norm_module()
    if built is None:
        pytest.skip("the norm kernel cannot be built here")
    so = Path(built.__file__)
    before = so.stat().st_mtime_ns
    done = subprocess.run([sys.executable, "-c", "import os; from hybrid.ops import cpu; "
                           "print(cpu.norm_module() is not None, os.environ['PATH'])"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": "/usr/bin:/bin"})  # the same HOME / HYBRID_CACHE: the same .so
    assert done.returncode == 0 and done.stdout.split() == ["True", "/usr/bin:/bin"], done.stderr  # PATH restored
    assert "compiling" not in done.stderr and so.stat().st_mtime_ns == before
