"""Strict loading: every way a checkpoint can be wrong gives an error naming the culprit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybrid
from hybrid.checkpoint_files import CheckpointError
from hybrid.config import ConfigError
from hybrid.saving import published_state_dict
from tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), max_shard_bytes=20_000)


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_weights(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_sharded_equals_single(single, sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    a, b = hybrid.load_model(single), hybrid.load_model(sharded)
    ids = torch.tensor([[5, 17, 3, 99, 250, 7]])
    assert torch.equal(a(ids), b(ids))
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_every_tensor_round_trips(single):
    model = hybrid.load_model(single)
    files = load_file(single / "model.safetensors")
    ours = published_state_dict(model)
    assert ours.keys() == files.keys()
    for k in files:
        assert torch.equal(ours[k], files[k]), k


def test_missing_shard(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing .*{shard.name}"):
        hybrid.load_model(d)


def test_missing_tensor(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_weights(d, lambda t: t.pop("backbone.layers.0.mixer.A_log"))
    with pytest.raises(CheckpointError, match=r"missing: backbone\.layers\.0\.mixer\.A_log"):
        hybrid.load_model(d)


def test_missing_expert(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_weights(d, lambda t: t.pop("backbone.layers.2.mixer.experts.2.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight"):
        hybrid.load_model(d)


def test_unexpected_tensor(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_weights(d, lambda t: t.update({"backbone.layers.1.mixer.q_norm.weight": torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"not used by the model.*q_norm"):
        hybrid.load_model(d)


def test_wrong_shape(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_weights(d, lambda t: t.update({"backbone.layers.1.mixer.k_proj.weight": torch.zeros(8, 32)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \[8, 32\]; the config expects \[16, 32\]"):
        hybrid.load_model(d)


def test_bad_pattern_character(single, tmp_path):
    d = _copy(single, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["hybrid_override_pattern"] = "M*Q-"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*unknown layer character 'Q' at position 2"):
        hybrid.load_model(d)


def test_unreadable_config(single, tmp_path):
    d = _copy(single, tmp_path)
    (d / "config.json").write_text('{"hybrid_override_pattern": ')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        hybrid.load_model(d)


def test_unreadable_index(sharded, tmp_path):
    d = _copy(sharded, tmp_path)
    (d / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: unreadable index"):
        hybrid.load_model(d)


def test_corrupt_safetensors(single, tmp_path):
    d = _copy(single, tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file"):
        hybrid.load_model(d)


def test_pickled_weights_are_refused(single, tmp_path):
    d = _copy(single, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: pickled weights are never loaded"):
        hybrid.load_model(d)


def test_quantized_checkpoint_is_refused_not_misread(single, tmp_path):
    d = _copy(single, tmp_path)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointError, match="quantized checkpoint"):
        hybrid.load_model(d)


def test_integer_tensor_is_refused(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_weights(d, lambda t: t.update({"backbone.layers.2.mixer.gate.weight": torch.zeros(4, 32, dtype=torch.uint8)}))
    with pytest.raises(CheckpointError, match=r"gate\.weight' is torch\.uint8"):
        hybrid.load_model(d)


def test_not_a_directory_nor_repo_id(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        hybrid.load_model(tmp_path / "nope" / "deeper" / "x")


def test_dtype_policy(single):
    model = hybrid.load_model(single, dtype="bf16")
    tensors = model.state_dict()  # dense names and dtypes, whether or not the weights are prepacked
    assert tensors["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    assert tensors["backbone.layers.2.mixer.gate.weight"].dtype == torch.float32
    assert tensors["backbone.layers.0.mixer.A_log"].dtype == torch.float32
    assert tensors["backbone.layers.2.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype 'int8'"):
        hybrid.load_model(single, dtype="int8")


def test_tied_head_must_equal_embeddings(tmp_path):
    d = write_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(d / "model.safetensors")
    model = hybrid.load_model(d)
    assert model.lm_head.weight is model.backbone.embeddings.weight
    _edit_weights(d, lambda t: t.update({"lm_head.weight": t["backbone.embeddings.weight"] + 1}))
    with pytest.raises(CheckpointError, match="tie_word_embeddings, but lm_head.weight differs"):
        hybrid.load_model(d)


def test_hub_repo_id_goes_through_huggingface_hub(single, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(single)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, tok = hybrid.load("nvidia/Some-Model-BF16")
    assert calls[0][0] == "nvidia/Some-Model-BF16" and "*.safetensors" in calls[0][2]
    assert not any(p.endswith((".bin", ".pt")) for p in calls[0][2])
    assert tok.stop_ids and model.config.hybrid_override_pattern == "M*E-"


def test_hub_failure_is_one_clear_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="nvidia/X: not a local directory, and downloading it from the hub failed"):
        hybrid.load_model("nvidia/X")
