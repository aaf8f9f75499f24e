"""The Triton kernels (fused dequantize + matmul, plain and grouped over experts) against the PyTorch path,
run by Triton's interpreter on the CPU (`TRITON_INTERPRET=1`; the kernels are the ones CUDA runs; how:
tests/interpreter.py).
"""

import pytest
import torch

pytest.importorskip("triton")
from interpreter import driver, needs_interpreter, run_in_interpreter  # noqa: E402


@driver
def test_kernels_in_the_interpreter():
    run_in_interpreter(__file__, "17 passed, 1 skipped", timeout=600)

from moe.experts import ExpertBank, QuantExpertBank  # noqa: E402
from moe.quant.kernels.experts import fused_experts  # noqa: E402
from moe.quant import QuantLinear  # noqa: E402
from moe.quant.config import modelopt_format  # noqa: E402
from moe.quant.formats import COMPRESSED_TENSORS, GPT_OSS_MXFP4  # noqa: E402


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
    "mxfp4": modelopt_format("MXFP4"),
    "mxfp4-ct": COMPRESSED_TENSORS["mxfp4-pack-quantized"],
    "mxfp4-gpt-oss": GPT_OSS_MXFP4,  # the same bytes as [out, in/32, 16] blocks
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


def _packed_bank(name: str, E: int, L: int, I: int, g: torch.Generator) -> QuantExpertBank:
    """A random expert bank of E experts (L -> I -> L) packed in format `name`."""
    bank = ExpertBank(E, L, I)
    with torch.no_grad():
        bank.up_proj.copy_(torch.randn(E, I, L, generator=g) * 0.1)
        bank.down_proj.copy_(torch.randn(E, L, I, generator=g) * 0.1)
    return QuantExpertBank.from_bank(bank, FORMATS[name], FORMATS[name], torch.ones(E), torch.ones(E))


@needs_interpreter
@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-block", "nvfp4", "mxfp4", "mxfp4-gpt-oss"])
def test_grouped_expert_kernel_equals_pytorch_path(kernels, name):
    g = torch.Generator().manual_seed(5)
    E, L, I, T, k = 6, 64, 96, 21, 2  # MXFP4 needs inputs in blocks of 32
    q = _packed_bank(name, E, L, I, g)
    x = torch.randn(T, L, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:, 0] = ids[:, 0] % 3  # uneven loads; experts 3..5 get fewer tokens, some maybe none
    weights = torch.rand(T, k, generator=g)
    got = fused_experts(x, weights, ids, q.up_proj, q.down_proj)  # the grouped kernel path
    want = q(x, weights, ids)  # the PyTorch path (CPU)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("name", ["fp8-tensor", "nvfp4", "mxfp4"])
def test_grouped_expert_kernel_skips_the_experts_of_other_ranks(kernels, name):
    """Under expert parallelism a rank's ids of experts another rank holds lie outside [0, E) (negative, or E and
    above): they add nothing, as in `dispatch`, instead of reading past the weight stack."""
    g = torch.Generator().manual_seed(7)
    E, L, I, T, k = 4, 64, 96, 19, 3
    q = _packed_bank(name, E, L, I, g)
    x = torch.randn(T, L, generator=g)
    ids = torch.randint(-3, 2 * E, (T, k), generator=g)  # about half of them elsewhere
    ids[0] = torch.tensor([E, -1, 2 * E - 1])  # a token with no expert here: a zero row
    weights = torch.rand(T, k, generator=g)
    inside = (ids >= 0) & (ids < E)
    want = torch.zeros(T, L, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            if inside[t, j]:
                e = int(ids[t, j])
                up, down = (p.dequantize(torch.float64, expert=e) for p in (q.up_proj, q.down_proj))
                want[t] += weights[t, j].double() * (torch.relu(x[t].double() @ up.T) ** 2 @ down.T)
    got = fused_experts(x, weights, ids, q.up_proj, q.down_proj)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q(x, weights, ids), got, rtol=1e-5, atol=1e-5)  # the forward takes this path
    assert got[0].abs().max() == 0


@needs_interpreter
def test_row_tiles_cover_each_expert_segment(kernels):
    """The real tiles first, in expert order; then empty ones (start == end) up to the bound the row count gives
    (ceil(39 / 16) + 5 tiles), so the grid's size never needs the counts on the host."""
    expert, start, end = kernels.row_tiles(torch.tensor([0, 20, 3, 0, 16]), block_m=16)
    assert expert.tolist()[:4] == [1, 1, 2, 4] and start.tolist()[:4] == [0, 16, 20, 23]
    assert end.tolist()[:4] == [20, 20, 23, 39]
    assert len(start) == 3 + 5 and start.tolist()[4:] == end.tolist()[4:]
    expert, start, end = kernels.row_tiles(torch.tensor([0, 20, 3, 0, 16]), block_m=16, max_rows=48)  # a looser bound
    assert len(start) == 3 + 5 and [(s, e) for s, e in zip(start.tolist(), end.tolist()) if s < e] == [
        (0, 20), (16, 20), (20, 23), (23, 39)]  # a tile runs from its start for block_m rows, up to its end
