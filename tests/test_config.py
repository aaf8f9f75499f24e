"""Config parsing of both dialects, validation messages, and the accounting of a real published config."""

import json
import math
from pathlib import Path

import pytest
import torch

from hybrid.accounting import describe
from hybrid.config import ConfigError, HybridConfig

NANO = Path(__file__).resolve().parents[1] / "checkpoints" / "configs" / "nemotron-3-nano-30b-a3b.config.json"
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


SIZES = dict(vocab_size=64, hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=4, n_groups=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=4, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=8, intermediate_size=8)


def nano_dict() -> dict:
    return json.loads(NANO.read_text())


def test_nvidia_dialect_with_legacy_names():
    raw = nano_dict()
    raw.update(mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=64, mamba_dt_limit=[0.001, 0.5])
    del raw["n_groups"], raw["conv_kernel"], raw["chunk_size"]
    c = HybridConfig.from_dict(raw)
    assert c.hybrid_override_pattern == NANO_PATTERN
    assert (c.n_groups, c.conv_kernel, c.chunk_size, c.time_step_limit) == (4, 3, 64, (0.001, 0.5))
    assert (c.n_routed_experts, c.num_experts_per_tok, c.routed_scaling_factor) == (128, 6, 2.5)
    assert c.torch_dtype == "bfloat16" and c.num_hidden_layers == 52


def test_transformers5_dialect_with_encoded_infinity():
    from transformers import NemotronHConfig

    tf = NemotronHConfig(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], n_groups=2,
                         mamba_num_heads=4, num_attention_heads=4, num_key_value_heads=2)
    raw = json.loads(tf.to_json_string())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}
    c = HybridConfig.from_dict(raw)
    assert c.hybrid_override_pattern == "ME*-"
    assert c.time_step_limit == (0.0, math.inf)


def test_legacy_block_type_names():
    c = HybridConfig.from_dict({"layers_block_type": ["mamba", "attention", "moe", "mlp"], **SIZES})
    assert c.hybrid_override_pattern == "M*E-"


def test_round_trip_and_transformers_reads_our_dialect(tmp_path):
    from transformers import NemotronHConfig

    c = HybridConfig.from_dict(nano_dict())
    again = HybridConfig.from_dict(c.to_dict())
    assert again == c
    c.save(tmp_path / "config.json")
    tf = NemotronHConfig.from_pretrained(tmp_path)
    assert tf.hybrid_override_pattern == NANO_PATTERN
    assert tf.n_groups == 8 and tf.moe_shared_expert_intermediate_size == 3712


def test_mtp_fields():
    c = HybridConfig.from_dict({"hybrid_override_pattern": "M*E", "num_nextn_predict_layers": 1,
                                "mtp_hybrid_override_pattern": "*E", "moe_latent_size": 16, **SIZES})
    assert (c.mtp_pattern, c.num_nextn_predict_layers, c.moe_latent_size) == ("*E", 1, 16)
    c = HybridConfig.from_dict({"layers_block_type": ["moe"], "num_nextn_predict_layers": 1,
                                "mtp_layers_block_type": ["attention", "moe"], **SIZES})
    assert c.mtp_pattern == "*E"


@pytest.mark.parametrize("change, field", [
    ({"hybrid_override_pattern": "M*X-"}, "hybrid_override_pattern"),
    ({"mamba_num_heads": 6, "n_groups": 4}, "mamba_num_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads"),
    ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok"),
    ({"n_routed_experts": 8, "n_group": 3}, "n_group"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_hidden_layers": 5}, "num_hidden_layers"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
])
def test_validation_names_the_field(change, field):
    raw = {"hybrid_override_pattern": "M*E-", **SIZES, **change}
    with pytest.raises(ConfigError, match=field):
        HybridConfig.from_dict(raw)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", "32", "`hidden_size` must be an integer, got '32'"),
    ("tie_word_embeddings", "yes", "`tie_word_embeddings` must be true or false"),
    ("routed_scaling_factor", None, "`routed_scaling_factor` must be a number"),
    ("time_step_limit", [0.1], "`time_step_limit` must be \\[low, high\\]"),
])
def test_wrong_types_are_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        HybridConfig.from_dict({"hybrid_override_pattern": "M*E-", **SIZES, field: value})


@pytest.mark.parametrize("pattern, drop", [("M", "ssm_state_size"), ("*", "head_dim"), ("E", "moe_intermediate_size"),
                                           ("-", "intermediate_size"), ("-", "hidden_size")])
def test_shape_fields_are_required(pattern, drop):
    raw = {"hybrid_override_pattern": pattern, **SIZES}
    del raw[drop]
    with pytest.raises(ConfigError, match=f"lacks `{drop}`"):
        HybridConfig.from_dict(raw)
    # a field only another layer kind needs may be absent
    if pattern == "-" and drop != "hidden_size":
        HybridConfig.from_dict({"hybrid_override_pattern": "M", **{k: v for k, v in SIZES.items() if k != drop}})


def test_unknown_block_type_is_named():
    with pytest.raises(ConfigError, match=r"layers_block_type\[1\].*'conv'"):
        HybridConfig.from_dict({"layers_block_type": ["mamba", "conv"]})


def test_unreadable_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        HybridConfig.from_file(path)


def test_nano_accounting_matches_published_numbers():
    """docs/semantics.md: 31,577,940,288 stored values; ~3.2B active (3.6B with embeddings);
    KV 6 layers * 2 * 2 heads * 128 * 2 bytes = 6,144 bytes per token; Mamba state
    23 * (64*64*128*4 + 6144*3*2) bytes per sequence."""
    r = describe(HybridConfig.from_dict(nano_dict()), torch.bfloat16)
    assert r["parameters"] == 31_577_940_288
    assert r["layers"] == {"mamba2": 23, "attention": 6, "moe": 23, "mlp": 0}
    assert 3.1e9 < r["active_parameters_per_token"] < 3.3e9
    assert 3.5e9 < r["active_parameters_per_token"] + r["embedding_parameters"] < 3.7e9
    assert r["kv_cache_bytes_per_token"] == 6 * 2 * 2 * 128 * 2 == 6144
    assert r["mamba_state_bytes_per_sequence"] == 23 * (64 * 64 * 128 * 4 + 6144 * 3 * 2)


def test_nano_bytes_read_per_token_by_hand():
    """A decode step reads every active weight once: bf16 ones 2 bytes, the fp32 ones 4 (23 routers
    [128, 2688] with their 128 correction biases; A_log, D, dt_bias of 64 heads in 23 Mamba layers), plus
    one bf16 row of the embedding."""
    r = describe(HybridConfig.from_dict(nano_dict()), torch.bfloat16)
    fp32 = 23 * (128 * 2688 + 128) + 23 * 3 * 64
    expected = 2 * (r["active_parameters_per_token"] - fp32) + 4 * fp32 + 2 * 2688
    assert r["active_weight_bytes_per_token"] == expected == 6_471_356_672
