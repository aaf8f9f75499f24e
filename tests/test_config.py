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


# ------------------------------------------------------------------------------------ untrusted values (issue 15)
def _write_config(tmp_path, **change) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hybrid_override_pattern": "M*E-", **SIZES, **change}))
    return path


SIZE = "a positive integer below 2^31"
TOKEN_IDS = "a token id (an integer in [0, 2^31)), a list of them, or null"


@pytest.mark.parametrize("field, value, expected", [
    ("eos_token_id", "2", TOKEN_IDS),
    ("eos_token_id", [2, "3"], TOKEN_IDS),
    ("eos_token_id", [[2]], TOKEN_IDS),
    ("eos_token_id", -1, TOKEN_IDS),
    ("eos_token_id", True, TOKEN_IDS),
    ("bos_token_id", [1], "a token id (an integer in [0, 2^31)) or null"),
    ("pad_token_id", "0", "a token id (an integer in [0, 2^31)) or null"),
    ("pad_token_id", 1.0, "a token id (an integer in [0, 2^31)) or null"),
    ("num_hidden_layers", "4", SIZE),
    ("num_hidden_layers", True, SIZE),
    ("num_hidden_layers", 4.0, SIZE),
    ("hidden_size", 16.0, SIZE),
    ("hidden_size", True, SIZE),
    ("hidden_size", [16], SIZE),
    ("hidden_size", -16, SIZE),
    ("hidden_size", 2**40, SIZE),
    ("conv_kernel", 0, SIZE),
    ("expand", 0, SIZE),
    ("max_position_embeddings", "4096", SIZE),
    ("n_shared_experts", -1, "an integer in [0, 2^31)"),
    ("num_nextn_predict_layers", "1", "0 or 1 (one MTP module at most is supported)"),
    ("num_nextn_predict_layers", 2, "0 or 1 (one MTP module at most is supported)"),
    ("moe_latent_size", True, "a positive integer below 2^31, or 0 or null for none"),
    ("moe_latent_size", -4, "a positive integer below 2^31, or 0 or null for none"),
    ("layer_norm_epsilon", -1e-5, "a finite number >= 0"),
    ("layer_norm_epsilon", math.nan, "a finite number >= 0"),
    ("time_step_min", "0.001", "a finite number >= 0"),
    ("routed_scaling_factor", math.inf, "a finite number > 0"),
    ("routed_scaling_factor", 0, "a finite number > 0"),
    ("routed_scaling_factor", None, "a finite number > 0"),
    ("time_step_limit", [True, 2], "[low, high] with 0 <= low <= high"),
    ("time_step_limit", [0.0, math.nan], "[low, high] with 0 <= low <= high"),
    ("time_step_limit", "ab", "[low, high] with 0 <= low <= high"),
    ("time_step_limit", [0.1], "[low, high] with 0 <= low <= high"),
    ("torch_dtype", 5, "one of 'float32', 'bfloat16', 'float16'"),
    ("torch_dtype", "int8", "one of 'float32', 'bfloat16', 'float16'"),
    ("mamba_ssm_cache_dtype", [], "one of 'float32', 'bfloat16', 'float16'"),
    ("mlp_hidden_act", 3, "'relu2' (the only activation supported)"),
    ("mamba_hidden_act", ["silu"], "'silu' (the only activation supported)"),
    ("tie_word_embeddings", 1, "true or false"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("use_conv_bias", "true", "true or false"),
    ("quantization_config", "fp8", "an object or null"),
    ("quantization_config", [1], "an object or null"),
    ("hybrid_override_pattern", 5, "a string of layer characters (M Mamba-2, * attention, E MoE, - MLP)"),
    ("mtp_hybrid_override_pattern", 5, "a string of layer characters (M Mamba-2, * attention, E MoE, - MLP)"),
])
def test_every_field_is_type_checked(tmp_path, field, value, expected):
    """A value of the wrong JSON type or range is a ConfigError naming the file, the key, the value and what
    was expected (before: TypeError for `eos_token_id: "2"` downstream, `mtp_hybrid_override_pattern: 5`...)."""
    path = _write_config(tmp_path, **{field: value})
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(path)
    assert str(info.value) == f"{path}: `{field}` must be {expected}, got {value!r}"


def test_num_hidden_layers_as_a_string_blames_the_type(tmp_path):
    path = _write_config(tmp_path, num_hidden_layers="4")
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(path)
    assert str(info.value) == f"{path}: `num_hidden_layers` must be {SIZE}, got '4'"
    assert HybridConfig.from_file(_write_config(tmp_path, num_hidden_layers=4)).num_hidden_layers == 4


def test_valid_values_of_every_kind_are_kept(tmp_path):
    c = HybridConfig.from_file(_write_config(
        tmp_path, eos_token_id=[2, 11], bos_token_id=None, pad_token_id=0, moe_latent_size=0,
        time_step_limit=[0, {"__float__": "Infinity"}], layer_norm_epsilon=0, routed_scaling_factor=2,
        n_shared_experts=0, quantization_config=None, torch_dtype="float16"))
    assert (c.eos_token_ids, c.bos_token_id, c.pad_token_id, c.moe_latent_size) == ([2, 11], None, 0, None)
    assert (c.time_step_limit, c.layer_norm_epsilon, c.routed_scaling_factor) == ((0.0, math.inf), 0, 2)
    assert (c.n_shared_experts, c.torch_dtype) == (0, "float16")


def test_validate_checks_the_types_of_a_config_built_in_python():
    with pytest.raises(ConfigError, match=r"^`hidden_size` must be a positive integer below 2\^31, got '16'$"):
        HybridConfig(hybrid_override_pattern="M*E-", **{**SIZES, "hidden_size": "16"}).validate()


@pytest.mark.parametrize("change, message", [
    ({"time_step_limit": [0, {"__float__": "nope"}]},
     "`time_step_limit[1]` is {'__float__': 'nope'}; expected a float spelled as a string, e.g. "
     "{\"__float__\": \"Infinity\"}"),
    ({"time_step_limit": [0, {"__float__": [1]}]},
     "`time_step_limit[1]` is {'__float__': [1]}; expected a float spelled as a string, e.g. "
     "{\"__float__\": \"Infinity\"}"),
    ({"__float__": "1"}, None),  # a top-level key, not an encoded float: kept as an unknown key
])
def test_encoded_floats_are_checked(tmp_path, change, message):
    path = _write_config(tmp_path, **change)
    if message is None:
        assert HybridConfig.from_file(path).extra == {"__float__": "1"}
        return
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(path)
    assert str(info.value) == f"{path}: {message}"


def test_block_types_that_are_not_names():
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_dict({"layers_block_type": ["mamba", ["moe"]], **SIZES})
    assert str(info.value) == ("`layers_block_type[1]` is ['moe']; expected one of ['attention', 'full_attention', "
                               "'linear_attention', 'mamba', 'mlp', 'moe']")


@pytest.mark.parametrize("content, message", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
    ('{"hybrid_override_pattern": "M", "x": ' + "[" * 900 + "]" * 900 + "}",
     "config nests lists or objects too deeply"),
    ('{"hybrid_override_pattern": "M", "eos_token_id": ' + "[" * 50 + "]" * 50 + "}",
     f"`eos_token_id` must be {TOKEN_IDS}, got [[[[[[[...]]]]]]]"),
    ('{"vocab_size": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
    (b"\xff\xfe{}", "not valid JSON ("),
    ("[1, 2]", "config must be a JSON object, got list"),
])
def test_unreadable_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_config_path_that_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(tmp_path / "config.json")
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: cannot read (")


@pytest.mark.parametrize("change, message", [
    ({"n_routed_experts": 2**31 - 1}, "`n_routed_experts` is 2,147,483,647; at most 65,536 experts per MoE layer are supported"),
    ({"hybrid_override_pattern": "M" * 200_000}, "`hybrid_override_pattern` describes 200,000 layers; at most 4,096 are supported"),
    ({"hidden_size": 2**31 - 1}, "the sizes describe 2.52e+16 parameters, more than the limit of 1e+14; the largest "
                                 "part is `n_routed_experts` (128) * `moe_intermediate_size` (1856) * `hidden_size` "
                                 "(2147483647) (MoE layers): 2.38e+16 parameters"),
])
def test_sizes_are_bounded_before_anything_is_built(tmp_path, change, message):
    raw = {**nano_dict(), **change}
    raw.pop("num_hidden_layers", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        HybridConfig.from_file(tmp_path / "config.json")
    assert str(info.value) == f"{tmp_path / 'config.json'}: {message}"


def test_parameter_terms_agree_with_the_built_model():
    c = HybridConfig.from_dict(nano_dict())
    counted = sum(n for _, n in c.parameter_terms())
    built = describe(c, torch.bfloat16)["parameters"]
    assert abs(counted - built) / built < 1e-4
