"""The fused Mamba-2 decode step on the CPU (`hybrid/ops/cpu_mamba.cpp`) against its PyTorch specification
(`hybrid.ops.decode`: the conv step and SSD step of conv1d.py / ssd.py on views of each sequence's rows), at
Nemotron 3 Nano's widths (64 heads x 64, state 128, 8 groups, conv_dim 6,144, kernel 4)."""

from __future__ import annotations

import math

import pytest
import torch

import hybrid.ops as ops
from hybrid.ops import conv1d, cpu, decode, ssd

pytestmark = pytest.mark.skipif(cpu.module() is None, reason="the Mamba decode kernel could not be built here")

NH, P, N, NG, K = 64, 64, 128, 8, 4
D_INNER = NH * P
CONV_DIM = D_INNER + 2 * NG * N


def inputs(dtype, S: int, rows: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    return dict(
        xBC=torch.randn(S, CONV_DIM, generator=g).to(dtype),
        dt=(torch.rand(S, NH, generator=g) * 6 - 4).to(dtype),  # softplus(dt + bias) spread over ~[0.01, 3]
        conv=torch.randn(rows, CONV_DIM, K - 1, generator=g).to(dtype),
        ssm=torch.randn(rows, NH, P, N, generator=g),
        weight=(torch.randn(CONV_DIM, K, generator=g) * 0.3).to(dtype),
        bias=(torch.randn(CONV_DIM, generator=g) * 0.1).to(dtype) if bias else None,
        dt_bias=torch.randn(NH, generator=g) * 0.5,
        A=-(torch.rand(NH, generator=g) * 8 + 0.5),
        D=torch.randn(NH, generator=g),
    )


def run(step, t, index, limit, **kw):
    conv, ssm = t["conv"].clone(), t["ssm"].clone()
    y = step(t["xBC"], t["dt"], conv, ssm, index, t["weight"], t["bias"], t["dt_bias"], t["A"], t["D"], limit, D_INNER,
             NG, **kw)
    return y, conv, ssm


def reference(*args, **kw):
    return decode.mamba_decode_step(*args, conv_step=conv1d.causal_conv1d_update, ssd_step=ssd.ssd_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.5)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_equals_the_specification_in_scattered_slots(dtype, limit, bias):
    """Five sequences in rows 7, 2, 5, 0, 8 of nine: outputs and states equal the specification up to the
    order of fp32 sums, the conv windows exactly, and the four other rows are not touched."""
    t = inputs(dtype, 5, 9, seed=1, bias=bias)
    index = torch.tensor([7, 2, 5, 0, 8])
    y, conv, ssm = run(ops.mamba_decode_step, t, index, limit)
    y_ref, conv_ref, ssm_ref = run(reference, t, index, limit)
    assert y.dtype == torch.float32 and y.shape == (5, NH, P)
    assert (y - y_ref).abs().max() <= 1e-6 * y_ref.abs().max()
    assert (ssm - ssm_ref).abs().max() <= 1e-6 * ssm_ref.abs().max()
    assert torch.equal(conv, conv_ref)
    others = [1, 3, 4, 6]
    assert torch.equal(ssm[others], t["ssm"][others]) and torch.equal(conv[others], t["conv"][others])


def test_the_clamp_is_active_in_the_test_above():
    """The (0.05, 0.5) limits change the result: both bounds bind for some heads."""
    t = inputs(torch.float32, 5, 9, seed=1)
    index = torch.tensor([7, 2, 5, 0, 8])
    dt = torch.nn.functional.softplus(t["dt"].float() + t["dt_bias"])
    assert (dt < 0.05).any() and (dt > 0.5).any()
    assert not torch.allclose(run(ops.mamba_decode_step, t, index, (0.05, 0.5))[0],
                              run(ops.mamba_decode_step, t, index, (0.0, math.inf))[0])


def test_a_dense_batch_and_repeated_steps_stay_on_the_specification():
    """Rows 0..R-1 in order (a dense cache's batch) over 20 steps: the states never drift apart."""
    t = inputs(torch.float32, 3, 3, seed=2)
    conv, ssm = t["conv"].clone(), t["ssm"].clone()
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    index = torch.arange(3)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        xBC = torch.randn(3, CONV_DIM, generator=g)
        args = (xBC, t["dt"], t["weight"], t["bias"], t["dt_bias"], t["A"], t["D"], (0.0, math.inf), D_INNER, NG)
        y = ops.mamba_decode_step(args[0], args[1], conv, ssm, index, *args[2:])
        y_ref = reference(args[0], args[1], conv_ref, ssm_ref, index, *args[2:])
        assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    assert (ssm - ssm_ref).abs().max() <= 1e-5 * ssm_ref.abs().max()
    assert torch.equal(conv, conv_ref)


def test_without_the_kernel_the_seam_is_the_specification(monkeypatch):
    t = inputs(torch.float32, 2, 4, seed=4)
    index = torch.tensor([3, 1])
    monkeypatch.setattr(ops._cpu, "module", lambda: None)
    y, conv, ssm = run(ops.mamba_decode_step, t, index, (0.0, math.inf))
    y_ref, conv_ref, ssm_ref = run(reference, t, index, (0.0, math.inf))
    assert torch.equal(y, y_ref) and torch.equal(ssm, ssm_ref) and torch.equal(conv, conv_ref)
