"""The fused CPU RMSNorms (`hybrid/ops/cpu_norm.cpp`) against float64 and their PyTorch specification
(`hybrid.ops.norm`), at Nemotron 3 Nano's widths (hidden 2,688; the Mamba mixer's d_inner 4,096 in 8 groups)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybrid.ops as ops
from hybrid.ops import cpu, norm

pytestmark = pytest.mark.skipif(cpu.norm_module() is None, reason="the RMSNorm kernel could not be built here")

HIDDEN, D_INNER, GROUPS, EPS = 2688, 4096, 8, 1e-5
DTYPES = [torch.float32, torch.bfloat16]


def rms64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def gated64(x, z, weight, groups, eps):
    g = (x.double() * F.silu(z.double())).unflatten(-1, (groups, -1))
    g = g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.flatten(-2) * weight.double()


def assert_rounded_from(out: torch.Tensor, ref64: torch.Tensor):
    """out is ref64 rounded to out's dtype, up to the fp32 arithmetic: 2e-6 relative in fp32, one unit in the
    last place (2^-8 relative) in bf16."""
    rel = 2e-6 if out.dtype == torch.float32 else 2.0 ** -8
    err = (out.double() - ref64).abs()
    assert (err <= rel * ref64.abs() + 1e-30).all(), f"max error {err.max():.3g}"


def assert_near_spec(out: torch.Tensor, spec: torch.Tensor):
    """The kernel against the PyTorch specification: the same up to the order of the fp32 sums (1e-6
    relative in fp32; in bf16 a rare rounding moved by one unit)."""
    if out.dtype == torch.float32:
        assert ((out - spec).abs() <= 1e-6 * spec.abs() + 1e-30).all()
    else:
        assert (out != spec).float().mean() <= 1e-3
        assert ((out.float() - spec.float()).abs() <= 2.0 ** -7 * spec.float().abs()).all()


def rows(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_rms_norm_equals_float64_and_the_specification(x_dtype, w_dtype):
    """Rows of very different scales (1e-3 to 1e3), as residual streams are; the weight spread around 1."""
    x = rows((2, 7, HIDDEN), x_dtype, 1) * torch.logspace(-3, 3, 7)[None, :, None].to(x_dtype)
    w = (1 + 0.5 * rows((HIDDEN,), torch.float32, 2)).to(w_dtype)
    out = ops.rms_norm(x, w, EPS)
    assert out.dtype == x_dtype and out.shape == x.shape
    assert_rounded_from(out, rms64(x, w, EPS))
    assert_near_spec(out, norm.rms_norm(x, w, EPS))


@pytest.mark.parametrize("z_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_gated_rms_norm_equals_float64_per_group(z_dtype, w_dtype, out_dtype):
    """Each of the 8 groups at its own scale, so one norm over the whole row would be far off."""
    x = rows((3, 5, D_INNER), torch.float32, 3) * torch.logspace(-2, 2, GROUPS).repeat_interleave(D_INNER // GROUPS)
    z = rows((3, 5, D_INNER), z_dtype, 4, scale=2.0)
    w = (1 + 0.5 * rows((D_INNER,), torch.float32, 5)).to(w_dtype)
    out = ops.gated_rms_norm(x, z, w, GROUPS, EPS, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    ref = gated64(x, z, w, GROUPS, EPS)
    assert_rounded_from(out, ref)
    whole_row = gated64(x, z, w, 1, EPS)
    assert (whole_row - ref).abs().max() > 0.1 * ref.abs().max()
    assert_near_spec(out, norm.gated_rms_norm(x, z, w, GROUPS, EPS, out_dtype))


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    """Serving batches decode rows with prefill rows: a row's result may not depend on its neighbours."""
    x = rows((64, HIDDEN), torch.bfloat16, 6)
    w = rows((HIDDEN,), torch.bfloat16, 7)
    batch = ops.rms_norm(x, w, EPS)
    for r in (0, 17, 63):
        assert torch.equal(ops.rms_norm(x[r:r + 1], w, EPS), batch[r:r + 1])
    xg, z = rows((64, D_INNER), torch.float32, 8), rows((64, D_INNER), torch.bfloat16, 9)
    wg = rows((D_INNER,), torch.bfloat16, 10)
    gated = ops.gated_rms_norm(xg, z, wg, GROUPS, EPS, torch.bfloat16)
    for r in (0, 40):
        assert torch.equal(ops.gated_rms_norm(xg[r:r + 1], z[r:r + 1], wg, GROUPS, EPS, torch.bfloat16), gated[r:r + 1])


def test_non_contiguous_inputs_and_the_eps_are_honoured():
    x = rows((HIDDEN, 6), torch.float32, 11).t()  # [6, HIDDEN], not contiguous
    w = rows((HIDDEN,), torch.float32, 12)
    assert_rounded_from(ops.rms_norm(x, w, EPS), rms64(x, w, EPS))
    tiny = x * 1e-4  # mean(x^2) ~ 1e-8, far below eps = 1e-2: eps decides the result
    assert_rounded_from(ops.rms_norm(tiny, w, 1e-2), rms64(tiny, w, 1e-2))


def test_gradients_take_the_specification():
    """Training records a graph: with a gradient wanted the seam is the PyTorch specification, whose backward
    then runs; without, the kernel (no graph)."""
    w = torch.nn.Parameter(1 + rows((HIDDEN,), torch.float32, 13))
    x = rows((3, HIDDEN), torch.float32, 14)
    out = ops.rms_norm(x, w, EPS)
    out.sum().backward()
    x64 = x.double()
    expected = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).sum(0)
    assert torch.allclose(w.grad.double(), expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert ops.rms_norm(x, w, EPS).grad_fn is None


def test_without_the_kernel_the_seam_is_the_specification(monkeypatch):
    monkeypatch.setattr(ops._cpu, "norm_module", lambda: None)
    x, w = rows((4, HIDDEN), torch.bfloat16, 15), rows((HIDDEN,), torch.bfloat16, 16)
    assert torch.equal(ops.rms_norm(x, w, EPS), norm.rms_norm(x, w, EPS))
    xg, z = rows((2, D_INNER), torch.float32, 17), rows((2, D_INNER), torch.bfloat16, 18)
    wg = rows((D_INNER,), torch.float32, 19)
    assert torch.equal(ops.gated_rms_norm(xg, z, wg, GROUPS, EPS, torch.bfloat16),
                       norm.gated_rms_norm(xg, z, wg, GROUPS, EPS, torch.bfloat16))


def test_the_kernel_refuses_what_it_does_not_compute():
    ext = cpu.norm_module()
    with pytest.raises(RuntimeError, match="weight must be \\[2688\\]"):
        ext.rms_norm(torch.zeros(2, HIDDEN), torch.ones(HIDDEN + 1), EPS)
    with pytest.raises(RuntimeError, match="n_groups 3 must divide 4096"):
        ext.gated_rms_norm(torch.zeros(1, D_INNER), torch.zeros(1, D_INNER), torch.ones(D_INNER), 3, EPS,
                           torch.float32)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        ext.gated_rms_norm(torch.zeros(1, D_INNER).bfloat16(), torch.zeros(1, D_INNER), torch.ones(D_INNER), 8, EPS,
                           torch.float32)
