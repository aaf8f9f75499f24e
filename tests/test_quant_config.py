"""Quantization configs: every documented form resolves per module; every wrong one is an error that names
the file, the key or the module (never bytes read as weights)."""

import json

import pytest
import torch

import hybrid
from hybrid.checkpoint_files import CheckpointError
from hybrid.quantize import quantize_model
from hybrid.saving import save_checkpoint
from moe.quant.config import QuantConfig, QuantConfigError
from test_loading import _copy, _edit_weights
from tiny_checkpoint import write_checkpoint

SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
             head_dim=16, mamba_head_dim=16)


def test_modelopt_exclusions_are_wildcards_over_modules_and_ancestors():
    qc = QuantConfig.from_modelopt({"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [
        "lm_head", "backbone.layers.4.mixer*", "*.conv1d", "backbone.layers.9.mixer.experts",
        "backbone.embeddings.\x00backbone.pt_name_sentinel"]}}, "hf_quant_config.json")
    assert qc.format_for("lm_head") is None and qc.format_for("backbone.embeddings") is None
    assert qc.format_for("backbone.layers.4.mixer.in_proj") is None
    assert qc.format_for("backbone.layers.9.mixer.experts.3.up_proj") is None  # an ancestor is excluded
    assert qc.format_for("backbone.layers.41.mixer.in_proj").label == "NVFP4"
    assert qc.format_for("backbone.layers.9.mixer.shared_experts.up_proj").label == "NVFP4"


@pytest.mark.parametrize("seed", range(3))
def test_exclusions_one_regex_equals_a_wildcard_per_ancestor(seed):
    """`excluded_by` first asks one compiled regex of every pattern; it must agree with the definition (fnmatch
    over the module and each ancestor, `re:` from the start) on names and patterns drawn at random from
    Nemotron module names, including `?`, `[..]`, `*` across dots and patterns recompiled after a change."""
    import random
    from fnmatch import fnmatch
    import re

    rng = random.Random(seed)
    parts = ["backbone", "layers", "mixer", "experts", "up_proj", "down_proj", "shared_experts", "in_proj", "lm_head",
             "conv1d", "gate", "mtp", *map(str, range(12))]
    names = [".".join(rng.choice(parts) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    names += ["backbone.layers.10.mixer.experts.11.up_proj", "backbone.layers.1.mixer", "lm_head"]

    def pattern():
        p = rng.choice(names)
        edits = [lambda q: q.replace(rng.choice(parts), "*", 1), lambda q: q[: rng.randint(0, len(q))] + "*",
                 lambda q: "*" + q[rng.randint(0, len(q)):], lambda q: q.replace("1", "?"),
                 lambda q: q.replace("1", "[12]"), lambda q: "re:" + re.escape(q[: rng.randint(1, len(q))]) + ".*",
                 lambda q: q]
        return rng.choice(edits)(p)

    def reference(qc, name):
        for p in qc.exclude:
            if (re.match(p[3:], name) if p.startswith("re:") else
                    any(fnmatch(".".join(name.split(".")[:i]), p) for i in range(1, name.count(".") + 2))):
                return p
        return None

    qc = QuantConfig.from_modelopt({"quantization": {"quant_algo": "FP8", "exclude_modules": []}}, "x.json")
    matched = unmatched = 0
    for _ in range(4):
        qc.exclude[:] = [pattern() for _ in range(rng.randint(0, 6))]
        got = [qc.excluded_by(n) for n in names]
        assert got == [reference(qc, n) for n in names], qc.exclude
        matched, unmatched = matched + sum(g is not None for g in got), unmatched + got.count(None)
    assert matched and unmatched  # both sides were drawn


def test_mixed_precision_is_per_module():
    qc = QuantConfig.from_modelopt({"quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                                                     "quantized_layers": {
        "backbone.layers.1.mixer.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "backbone.layers.1.mixer.shared_experts.up_proj": {"quant_algo": "FP8"}}, "exclude_modules": []}}, "x.json")
    assert qc.format_for("backbone.layers.1.mixer.experts.0.up_proj").label == "NVFP4"
    assert qc.format_for("backbone.layers.1.mixer.shared_experts.up_proj").label == "FP8"
    assert qc.format_for("backbone.layers.1.mixer.shared_experts.down_proj") is None  # not listed: unquantized
    assert qc.kv_cache == "FP8"


def test_compressed_tensors_targets_ignore_and_priority():
    block = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*gate$"],
             "config_groups": {
                 "fp8": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                         "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
                 "fp4": {"targets": ["re:.*\\.experts\\..*"], "format": "nvfp4-pack-quantized",
                         "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                         "input_activations": {"num_bits": 4, "type": "float", "dynamic": "local", "group_size": 16}}}}
    qc = QuantConfig.from_quantization_config(block, "config.json")
    assert qc.format_for("m.experts.0.up_proj").label == "NVFP4" and qc.format_for("m.experts.0.up_proj").layout.divisor
    fp8 = qc.format_for("m.shared_experts.up_proj")
    assert fp8.label == "FP8-channel" and not fp8.layout.input_scale
    assert qc.format_for("m.gate") is None and qc.format_for("lm_head") is None
    assert set(qc.format_for("m.experts.0.up_proj").tensor_specs(8, 32)) == {
        "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}


@pytest.mark.parametrize("block, match", [
    ({"quant_method": "awq", "bits": 4}, r"config\.json: quantization_config\.quant_method 'awq' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, r"quant_algo 'W4A8_AWQ' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, r"group_size 32"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     r"config_groups\.g: compressed-tensors format 'pack-quantized' is not supported"),
])
def test_unknown_or_malformed_configs_are_named_errors(block, match):
    with pytest.raises(QuantConfigError, match=match):
        QuantConfig.from_quantization_config(block, "config.json")


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    src = write_checkpoint(tmp_path_factory.mktemp("src"), pattern="ME*E", seed=1, **SIZES)
    model = quantize_model(hybrid.load_model(src, dtype="bf16"), "nvfp4", exclude=["lm_head", "backbone.embeddings"])
    return save_checkpoint(model, tmp_path_factory.mktemp("nvfp4"))


def test_unknown_method_in_a_checkpoint_names_the_file(nvfp4_dir, tmp_path):
    d = _copy(nvfp4_dir, tmp_path)
    (d / "hf_quant_config.json").unlink()
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json: quantization_config\.quant_method 'bitsandbytes'"):
        hybrid.load_model(d)


def test_tensor_not_matching_the_declared_format_names_module_and_format(nvfp4_dir, tmp_path):
    d = _copy(nvfp4_dir, tmp_path)
    name = "backbone.layers.3.mixer.shared_experts.up_proj"
    _edit_weights(d, lambda t: t.update({f"{name}.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=rf"'{name}\.weight' is torch\.float8_e4m3fn \[64, 64\], but "
                                              rf".*hf_quant_config\.json declares module '{name}' NVFP4, which stores "
                                              r"'weight' as torch\.uint8 \[64, 32\]"):
        hybrid.load_model(d)


def test_scales_of_an_excluded_module_are_not_silently_dropped(nvfp4_dir, tmp_path):
    d = _copy(nvfp4_dir, tmp_path)
    hq = json.loads((d / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].append("backbone.layers.3.mixer.shared_experts.*")
    (d / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=r"shared_experts\.up_proj\.weight' is torch\.uint8, not a floating-point "
                                              r"weight; quantized checkpoint: .* leaves this module unquantized"):
        hybrid.load_model(d)


def test_a_bf16_checkpoint_declared_quantized_is_refused(tmp_path):
    d = write_checkpoint(tmp_path / "plain", pattern="M*E-", **SIZES)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointError, match=r"quantized checkpoint: tensor 'backbone\.layers\.0\.mixer\.in_proj\.weight' "
                                              r"is torch\.float32 .* declares module .* FP8"):
        hybrid.load_model(d)


def test_kv_cache_scales_are_kept(nvfp4_dir, tmp_path):
    d = _copy(nvfp4_dir, tmp_path)
    hq = json.loads((d / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = "FP8"
    (d / "hf_quant_config.json").write_text(json.dumps(hq))
    _edit_weights(d, lambda t: t.update({"backbone.layers.2.mixer.k_proj.k_scale": torch.tensor(0.5),
                                 "backbone.layers.2.mixer.v_proj.v_scale": torch.tensor(0.25)}))
    model = hybrid.load_model(d, dtype="bf16")
    attn = model.backbone.layers[2].mixer
    assert attn.k_proj.k_scale.item() == 0.5 and attn.v_proj.v_scale.dtype == torch.float32
    assert model.quantization.kv_cache == "FP8"
