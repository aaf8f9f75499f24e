"""The CUDA path against the PyTorch specification: mamba-ssm's Triton SSD kernels and causal-conv1d's decode
conv step behind the `hybrid.ops` seam, at Nemotron 3 Nano's Mamba-2 widths, and a whole model on the GPU
against the same model on the CPU.

Skipped without a CUDA device (the CPU runs of the seam: tests/test_kernel_seam.py; the GPU code path under Triton's
interpreter: tests/test_triton_backend.py); the kernel tests skip, naming the import error, when the optional
packages (extra `cuda`) do not import, and fail instead under HYBRID_REQUIRE_CUDA_KERNELS=1. Tolerances: the Triton
scans may use TF32 dot products (10-bit mantissas), so each result is held to 1e-2 of the largest reference value (a
wrong decay, group mapping or state hand-over is off by O(1)); the model's greedy tokens must agree exactly.
"""

from __future__ import annotations

import pytest
import torch

import hybrid
import hybrid.ops as ops
from hybrid.ops import conv1d as ref_conv
from hybrid.ops import ssd as ref_ssd
from moe.quant.kernels import backend
from helpers import greedy_all_logits
from tiny_checkpoint import write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# Nemotron 3 Nano's Mamba-2 mixer: 64 heads x 64, 8 groups, state 128, chunk 128, conv 4 over x, B and C
HEADS, HEAD_DIM, GROUPS, STATE, CHUNK, KERNEL = 64, 64, 8, 128, 128, 4
CONV_DIM = HEADS * HEAD_DIM + 2 * GROUPS * STATE


def needs(loader, what):
    """Skip where the kernel package does not import (the reason names its import error), unless
    HYBRID_REQUIRE_CUDA_KERNELS=1: then the test runs and fails, so a green run proves the kernels ran."""
    missing = torch.cuda.is_available() and loader() is None and not backend.require_kernels()
    return pytest.mark.skipif(missing, reason=f"{what} does not import: {ops.import_error(what)} "
                                              "(HYBRID_REQUIRE_CUDA_KERNELS=1 makes this a failure)")


def inputs(b, T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, HEADS, HEAD_DIM, generator=g)
    dt = torch.rand(b, T, HEADS, generator=g) * 0.1 + 0.001  # already softplus-ed and clamped, as the mixer passes it
    A = -torch.rand(HEADS, generator=g) * 8 - 1
    B, C = (torch.randn(b, T, GROUPS, STATE, generator=g) for _ in range(2))
    state = torch.randn(b, HEADS, HEAD_DIM, STATE, generator=g) * 0.5
    return x, dt, A, B, C, state


def close(got, want, what):
    err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err <= 1e-2, f"{what}: max error {err:.2e} of the largest value"
    return err


@needs(ops._mamba_ssm, "mamba-ssm")
@pytest.mark.parametrize("T", [1, 300])  # 300: two full chunks of 128 and a partial one
def test_the_ssd_scan_kernel_equals_the_specification(T):
    x, dt, A, B, C, state = inputs(2, T, seed=T)
    want_y, want_state = ref_ssd.ssd_scan(*(t.double() for t in (x, dt, A, B, C)), CHUNK, state.double())
    y, final = ops.ssd_scan(*(t.cuda() for t in (x, dt, A, B, C)), CHUNK, state.cuda())
    assert y.is_cuda and y.dtype == torch.float32 and y.shape == want_y.shape and final.shape == want_state.shape
    close(y, want_y.double(), "y")
    close(final, want_state.double(), "final state")


@needs(ops._mamba_ssm, "mamba-ssm")
def test_the_recurrent_step_kernel_updates_the_state_in_place():
    x, dt, A, B, C, state = inputs(3, 1, seed=7)
    want_state = state.clone()  # the step's state is fp32 by definition (`mamba_ssm_cache_dtype`)
    want_y = ref_ssd.ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], want_state).double()
    on_gpu = state.cuda()
    y = ops.ssd_step(x[:, 0].cuda(), dt[:, 0].cuda(), A.cuda(), B[:, 0].cuda(), C[:, 0].cuda(), on_gpu)
    close(y, want_y, "y")
    close(on_gpu, want_state.double(), "state")


@needs(ops._causal_conv1d, "causal-conv1d")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_step_kernel_equals_the_specification(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, CONV_DIM, generator=g).to(dtype)
    window = torch.randn(4, CONV_DIM, KERNEL - 1, generator=g).to(dtype)
    weight = (torch.randn(CONV_DIM, KERNEL, generator=g) * 0.5).to(dtype)
    bias = torch.randn(CONV_DIM, generator=g).to(dtype)
    want_window = window.double()
    want = ref_conv.causal_conv1d_update(x.double(), want_window, weight.double(), bias.double())
    on_gpu = window.cuda()
    out = ops.conv_step(x.cuda(), on_gpu, weight.cuda(), bias.cuda())
    assert out.dtype == dtype and out.shape == want.shape
    close(out, want, "conv output")
    assert torch.equal(on_gpu.cpu().double(), want_window.to(dtype).double()), "the window did not roll in place"


def checkpoint(directory, pattern):
    # widths of 16 and more: the Triton kernels' smallest tiles
    return write_checkpoint(directory, pattern=pattern, seed=5, hidden_size=64, mamba_num_heads=4, mamba_head_dim=16,
                            n_groups=2, ssm_state_size=16, chunk_size=16)


def cpu_and_gpu(directory, pattern):
    """Prompts of 37 tokens (two chunks and a part) in a batch of 2, then 12 greedy steps, fp32, on both."""
    path = checkpoint(directory, pattern)
    ids = torch.randint(5, 320, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = greedy_all_logits(hybrid.load_model(path, dtype="fp32"), ids, 12)
        got = greedy_all_logits(hybrid.load_model(path, dtype="fp32", device="cuda"), ids.cuda(), 12)
    return got, want


def test_a_dense_model_on_the_gpu_decodes_as_on_the_cpu(tmp_path):
    """Mamba, attention and MLP layers (no routing): the same greedy tokens, logits within 1e-2 of the largest."""
    got, want = cpu_and_gpu(tmp_path, "M*M-M")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_a_moe_model_on_the_gpu_picks_the_cpus_tokens(tmp_path):
    """With MoE layers the same greedy tokens. The logits are not held to a tolerance: a near-tie of the router
    can pick another expert for one token under the kernels' TF32 rounding, a discrete change (seen on an H200:
    most logits within ~1e-3, one position off by 1.2 of 9.4, every argmax equal)."""
    got, want = cpu_and_gpu(tmp_path, "M*MEM-")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
