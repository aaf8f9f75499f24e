"""The streamed `hybrid quantize` (`quantize_checkpoint`: one layer, one expert, one shard at a time) writes
bit for bit the checkpoint that quantizing the whole model in memory writes (`quantize_model` +
`save_checkpoint`), calibration included; the in-memory path is itself checked against ModelOpt and
compressed-tensors in test_quant_checkpoints.py and test_quant_oracles.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import hybrid
from hybrid.checkpoint_files import CheckpointFiles
from hybrid.config import HybridConfig
from hybrid.quantize import calibrate, calibrate_streamed, plan, quantize_checkpoint, quantize_model
from tiny_checkpoint import write_checkpoint

SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
             head_dim=16, mamba_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("stream_src"), pattern="ME*EM-E", seed=9, **SIZES)


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 300, (1, 23), generator=g) for _ in range(3)]


def tensors(directory) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_streamed_calibration_equals_the_in_memory_one(source, batches):
    config = HybridConfig.from_file(source / "config.json")
    qc = plan(config, "nvfp4", exclude=["backbone.embeddings"])  # lm_head calibrated too
    whole = calibrate(hybrid.load_model(source, dtype="bf16", prepack=False), qc, batches)
    streamed = calibrate_streamed(CheckpointFiles(source), config, torch.bfloat16, qc, batches)
    assert whole.linear.keys() == streamed.linear.keys() and "lm_head" in whole.linear
    assert all(torch.equal(whole.linear[k], streamed.linear[k]) for k in whole.linear)
    assert whole.experts.keys() == streamed.experts.keys() and len(whole.experts) == 4  # 3 MoE layers + MTP
    for k in whole.experts:
        assert all(torch.equal(a, b) for a, b in zip(whole.experts[k], streamed.experts[k])), k


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_streamed_checkpoint_equals_the_in_memory_one(source, batches, tmp_path, fmt):
    model = quantize_model(hybrid.load_model(source, dtype="bf16", prepack=False), fmt, calibration=batches)
    hybrid.save_checkpoint(model, tmp_path / "memory", source=source)
    report = quantize_checkpoint(source, tmp_path / "stream", fmt, calibration=batches, dtype="bf16",
                                 max_shard_bytes=40_000)
    assert len(report.shards) > 2  # shards written as they filled
    a, b = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k  # bit for bit
    for name in ("config.json", "hf_quant_config.json", "tokenizer.json"):
        assert json.loads((tmp_path / "memory" / name).read_text()) == json.loads((tmp_path / "stream" / name).read_text())
    if fmt != "mxfp4":  # calibrated static input scales, not the default 1.0
        assert float(b["backbone.layers.1.mixer.experts.3.up_proj.input_scale"]) != 1.0
    ids = batches[0]
    with torch.no_grad():
        assert torch.equal(hybrid.load_model(tmp_path / "stream")(ids), hybrid.load_model(tmp_path / "memory")(ids))


def test_refusals(source, tmp_path):
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(source, tmp_path / "a", "fp8")
        quantize_checkpoint(tmp_path / "a", tmp_path / "b", "fp8")
    with pytest.raises(ValueError, match="is the source"):
        quantize_checkpoint(source, source, "fp8", overwrite=True)
    with pytest.raises(ValueError, match="--format 'int4' is not supported"):
        quantize_checkpoint(source, tmp_path / "c", "int4")
    assert not (tmp_path / "c").exists()
