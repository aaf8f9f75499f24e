"""The CUDA kernel seam (hybrid.ops), exercised on the CPU.

mamba-ssm and causal-conv1d cannot run here. transformers ships PyTorch functions with the same signatures
as those kernels (`mamba2_chunk_scan` ~ mamba_chunk_scan_combined, `mamba2_selective_state_update` ~
selective_state_update, `causal_conv1d_update`); routing our seam through them checks the argument
plumbing (shapes, dt handling, in-place state updates) of the kernel path against our reference path.
"""

import pytest
import torch

import hybrid
import hybrid.ops as ops
from helpers import greedy_all_logits
from tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hybrid.load_model(write_checkpoint(tmp_path_factory.mktemp("seam"), pattern="M*MEM", seed=11))


@pytest.mark.skipif(ops._mamba_ssm() is not None or ops._causal_conv1d() is not None,
                    reason="the packages are installed: transformers' functions call them, on CPU tensors too "
                           "(seen with transformers 5.17); tests/test_cuda_path.py runs the real kernels")
def test_kernel_signatures_give_the_reference_results(model, monkeypatch):
    from transformers.models.nemotron_h import modeling_nemotron_h as tf

    ids = torch.randint(0, 320, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = greedy_all_logits(model, ids, 6)
        monkeypatch.setattr(ops, "_kernel", lambda t, loader: loader())
        monkeypatch.setattr(ops, "_mamba_ssm", lambda: (tf.mamba2_chunk_scan, tf.mamba2_selective_state_update))
        monkeypatch.setattr(ops, "_causal_conv1d", lambda: tf.causal_conv1d_update)
        through_seam = greedy_all_logits(model, ids, 6)
    assert torch.allclose(through_seam, reference, atol=1e-4, rtol=0)  # fp32 rounding of a different summation order


def test_cpu_tensors_use_pytorch():
    assert ops._kernel(torch.zeros(1), lambda: pytest.fail("kernel loader called for a CPU tensor")) is None
