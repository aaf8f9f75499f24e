"""The fused Mamba-2 kernels on the CPU (`hybrid/ops/cpu_mamba.cpp`) against their PyTorch specifications at
Nemotron 3 Nano's widths (64 heads x 64, state 128, 8 groups, conv_dim 6,144, kernel 4): the decode step
(`hybrid.ops.decode`: the conv step and SSD step of conv1d.py / ssd.py on views of each sequence's rows) and
the prompt chunks of several sequences (each chunk alone through `conv1d.causal_conv1d` and `ssd.ssd_scan`)."""

from __future__ import annotations

import math

import pytest
import torch

import hybrid.ops as ops
from hybrid.ops import conv1d, cpu, decode, ssd

pytestmark = pytest.mark.skipif(cpu.module() is None, reason="the Mamba kernels could not be built here")

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


# The prompt-chunk kernel (`hybrid.ops.mamba_chunks_fused`): the specification is each sequence's chunk alone
# through the mixer's prefill (`conv1d.causal_conv1d` continuing its window, then `ssd.ssd_scan` continuing its
# state, plus the D skip); the kernel runs the recurrent form, the same sums in another order.

def chunks_reference(t, starts, lengths, index, limit, chunk_size=128):
    conv, ssm = t["conv"].clone(), t["ssm"].clone()
    L = t["xBC"].shape[0]
    y = torch.zeros(L, NH, P)
    A = t["A"]
    for s0, n, row in zip(starts.tolist(), lengths.tolist(), index.tolist()):
        xBC = t["xBC"][s0:s0 + n]
        out, xpad = conv1d.causal_conv1d(xBC.T[None], t["weight"], t["bias"], conv[row:row + 1])
        conv[row] = xpad[0, :, -(K - 1):]
        xs, B, C = out[0].T.split([D_INNER, NG * N, NG * N], dim=-1)
        dt = torch.nn.functional.softplus(t["dt"][s0:s0 + n].float() + t["dt_bias"]).clamp(*limit)
        ys, final = ssd.ssd_scan(xs.reshape(1, n, NH, P), dt[None], A, B.reshape(1, n, NG, N), C.reshape(1, n, NG, N),
                                 chunk_size, ssm[row:row + 1])
        ssm[row] = final[0]
        y[s0:s0 + n] = ys[0] + t["D"][:, None] * xs.float().reshape(n, NH, P)
    return y, conv, ssm


def run_chunks(t, starts, lengths, index, limit):
    conv, ssm = t["conv"].clone(), t["ssm"].clone()
    y = ops.mamba_chunks_fused(t["xBC"], t["dt"], conv, ssm, starts, lengths, index, t["weight"], t["bias"],
                               t["dt_bias"], t["A"], t["D"], limit, D_INNER, NG)
    return y, conv, ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.5)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_chunk_kernel_equals_the_prefill_in_scattered_slots(dtype, limit, bias):
    """Four sequences' chunks of 2, 3 (shorter than, equal to the conv window), 40 and 150 tokens (across a scan
    chunk of 128), packed out of order with a gap row, in slots 6, 1, 4, 0 of eight: outputs and states equal the
    specification up to the order of fp32 sums, the conv windows exactly, and the other rows are not touched."""
    t = inputs(dtype, 210, 8, seed=5, bias=bias)
    starts, lengths = torch.tensor([10, 0, 13, 60]), torch.tensor([3, 2, 40, 150])
    index = torch.tensor([6, 1, 4, 0])
    y, conv, ssm = run_chunks(t, starts, lengths, index, limit)
    y_ref, conv_ref, ssm_ref = chunks_reference(t, starts, lengths, index, limit)
    assert y.dtype == torch.float32 and y.shape == (210, NH, P)
    assert (y - y_ref).abs().max() <= 2e-6 * y_ref.abs().max()
    assert (ssm - ssm_ref).abs().max() <= 2e-6 * ssm_ref.abs().max()
    assert torch.equal(conv, conv_ref)
    others = [2, 3, 5, 7]
    assert torch.equal(ssm[others], t["ssm"][others]) and torch.equal(conv[others], t["conv"][others])
    assert not y[2:10].any() and not y[53:60].any()  # rows of no segment stay zero


def test_the_chunk_kernel_handles_state_sizes_off_the_register_block():
    """N = 72 (a block of 64 entries, one of 16 would leave 8: the scalar tail), 3 heads of 5, 1 group."""
    nh, p, n, ng, k = 3, 5, 72, 1, 4
    d_inner = nh * p
    cdim = d_inner + 2 * ng * n
    g = torch.Generator().manual_seed(6)
    xBC = torch.randn(30, cdim, generator=g)
    dt = torch.rand(30, nh, generator=g) * 4 - 3
    conv, ssm = torch.randn(2, cdim, k - 1, generator=g), torch.randn(2, nh, p, n, generator=g)
    weight, bias = torch.randn(cdim, k, generator=g) * 0.3, torch.randn(cdim, generator=g) * 0.1
    dt_bias, A, D = torch.randn(nh, generator=g), -(torch.rand(nh, generator=g) * 4 + 0.5), torch.randn(nh, generator=g)
    c1, s1 = conv.clone(), ssm.clone()
    y = ops.mamba_chunks_fused(xBC, dt, c1, s1, torch.tensor([0]), torch.tensor([30]), torch.tensor([1]), weight, bias,
                               dt_bias, A, D, (0.0, math.inf), d_inner, ng)
    out, xpad = conv1d.causal_conv1d(xBC.T[None], weight, bias, conv[1:2])
    xs, B, C = out[0].T.split([d_inner, n, n], dim=-1)
    dts = torch.nn.functional.softplus(dt + dt_bias)
    y_ref, final = ssd.ssd_scan(xs.reshape(1, 30, nh, p), dts[None], A, B.reshape(1, 30, 1, n), C.reshape(1, 30, 1, n),
                                8, ssm[1:2])
    y_ref = y_ref[0] + D[:, None] * xs.reshape(30, nh, p)
    assert (y - y_ref).abs().max() <= 2e-6 * y_ref.abs().max()
    assert (s1[1] - final[0]).abs().max() <= 2e-6 * final.abs().max()
    assert torch.equal(c1[1], xpad[0, :, -(k - 1):]) and torch.equal(s1[0], ssm[0]) and torch.equal(c1[0], conv[0])


def test_a_chunk_split_in_two_calls_equals_one_call():
    """The state a chunk leaves is where the next one starts: 100 tokens as 37 + 63 equal 100 at once (to fp32
    rounding: the recurrent form sums in the same order either way, so exactly)."""
    t = inputs(torch.bfloat16, 100, 1, seed=7)
    index = torch.tensor([0])
    y, conv, ssm = run_chunks(t, torch.tensor([0]), torch.tensor([100]), index, (0.0, math.inf))
    c2, s2 = t["conv"].clone(), t["ssm"].clone()
    parts = [ops.mamba_chunks_fused(t["xBC"][a:b], t["dt"][a:b], c2, s2, torch.tensor([0]), torch.tensor([b - a]),
                                    index, t["weight"], t["bias"], t["dt_bias"], t["A"], t["D"], (0.0, math.inf),
                                    D_INNER, NG) for a, b in [(0, 37), (37, 100)]]
    assert torch.equal(torch.cat(parts), y) and torch.equal(s2, ssm) and torch.equal(c2, conv)


def test_the_chunk_kernel_refuses_segments_outside_the_rows_or_overlapping():
    t = inputs(torch.float32, 10, 2, seed=8)
    with pytest.raises(RuntimeError, match="segment 0 outside the rows"):
        run_chunks(t, torch.tensor([5]), torch.tensor([6]), torch.tensor([0]), (0.0, math.inf))
    with pytest.raises(RuntimeError, match="segments overlap"):
        run_chunks(t, torch.tensor([4, 0]), torch.tensor([3, 5]), torch.tensor([0, 1]), (0.0, math.inf))


def test_without_the_kernel_the_chunk_seam_says_none(monkeypatch):
    """No kernel: the seam returns None and the mixer runs its PyTorch prefill (tests/test_engine.py covers that
    path with HYBRID_CPU_KERNELS=0)."""
    t = inputs(torch.float32, 4, 1, seed=9)
    monkeypatch.setattr(ops._cpu, "module", lambda: None)
    assert run_chunks(t, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), (0.0, math.inf))[0] is None
