"""The Triton kernels (fused dequantize + matmul, plain and grouped over experts) against the PyTorch path,
run by Triton's interpreter on the CPU (`TRITON_INTERPRET=1`; the kernels are the ones CUDA runs).

Triton reads TRITON_INTERPRET when it is first imported (its own `tl` helpers are built then), and other
test modules import it earlier through compressed-tensors; so unless this process already interprets,
`test_kernels_in_the_interpreter` runs this file again in a fresh process with the flag set.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


@pytest.mark.skipif(INTERPRETING, reason="this is the driver")
def test_kernels_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p", "no:warnings"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "9 passed, 1 skipped" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]

from moe.experts import ExpertBank, QuantExpertBank  # noqa: E402
from moe.quant import QuantLinear  # noqa: E402
from moe.quant.config import modelopt_format  # noqa: E402
from moe.quant.formats import COMPRESSED_TENSORS  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    import moe.quant.kernels.triton as tk

    return tk


FORMATS = {
    "fp8-tensor": modelopt_format("FP8"),
    "fp8-channel": modelopt_format("FP8_PER_CHANNEL_PER_TOKEN"),
    "fp8-block": modelopt_format("FP8_PB_WO"),
    "nvfp4": modelopt_format("NVFP4"),
    "nvfp4-ct": COMPRESSED_TENSORS["nvfp4-pack-quantized"],
}


def _linear(fmt, in_f, out_f, seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(out_f, generator=g))
    return QuantLinear.from_linear(lin, fmt, torch.tensor(3.0))


@needs_interpreter
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_linear_kernel_equals_pytorch_path(kernels, name):
    q = _linear(FORMATS[name], 160, 200, seed=len(name))  # partial tiles and partial 128-blocks
    x = torch.randn(2, 9, 160, generator=torch.Generator().manual_seed(1))
    assert kernels.supports(q.fmt)
    got = kernels.linear(x, q, q.bias)
    want = torch.nn.functional.linear(x, q.dequantize(torch.float32), q.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-block", "nvfp4"])
def test_grouped_expert_kernel_equals_pytorch_path(kernels, name):
    g = torch.Generator().manual_seed(5)
    E, L, I, T, k = 6, 64, 48, 21, 2
    bank = ExpertBank(E, L, I)
    with torch.no_grad():
        bank.up_proj.copy_(torch.randn(E, I, L, generator=g) * 0.1)
        bank.down_proj.copy_(torch.randn(E, L, I, generator=g) * 0.1)
    q = QuantExpertBank.from_bank(bank, FORMATS[name], FORMATS[name], torch.ones(E), torch.ones(E))
    x = torch.randn(T, L, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:, 0] = ids[:, 0] % 3  # uneven loads; experts 3..5 get fewer tokens, some maybe none
    weights = torch.rand(T, k, generator=g)
    got = q.fused(x, weights, ids)  # the grouped kernel path
    want = q(x, weights, ids)  # the PyTorch path (CPU)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_row_tiles_cover_each_expert_segment(kernels):
    expert, start, end = kernels.row_tiles(torch.tensor([0, 20, 3, 0, 16]), block_m=16)
    assert expert.tolist() == [1, 1, 2, 4] and start.tolist() == [0, 16, 20, 23] and end.tolist() == [20, 20, 23, 39]
