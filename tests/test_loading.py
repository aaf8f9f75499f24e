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


# ------------------------------------------------------------------------------------ untrusted bytes (issue 15)
def _edit_config(directory, **change):
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **change}))


def test_config_value_of_the_wrong_type_names_file_key_and_value(single, tmp_path):
    d = _copy(single, tmp_path)
    _edit_config(d, eos_token_id="2")  # before: a TypeError in the tokenizer (sorted ids of int and str)
    with pytest.raises(ConfigError) as info:
        hybrid.load(d, progress=False)
    assert str(info.value) == (f"{d / 'config.json'}: `eos_token_id` must be a token id (an integer in [0, 2^31)), "
                               "a list of them, or null, got '2'")


@pytest.mark.parametrize("change, message", [
    # before: MemoryError after 28 s and 7.5 GB, building the experts on meta
    ({"n_routed_experts": 2**31 - 1}, "`n_routed_experts` is 2,147,483,647; at most 65,536 experts"),
    # before: 10 s and 2.6 GB, then a shape mismatch
    ({"n_routed_experts": 10_000_000}, "`n_routed_experts` is 10,000,000; at most 65,536 experts"),
    # before: > 120 s and 3.7 GB in building the model
    ({"hybrid_override_pattern": "M" * 200_000, "num_hidden_layers": 200_000},
     "`hybrid_override_pattern` describes 200,000 layers; at most 4,096"),
    # before: "the config's sizes describe a tensor too large for torch (...)", naming neither file nor field
    ({"hidden_size": 2**31 - 1, "vocab_size": 2**20}, "more than the limit of 1e+14; the largest part is "
                                                       "`vocab_size` (1048576) * `hidden_size` (2147483647)"),
    ({"intermediate_size": 2**31 - 1, "hidden_size": 2**20},
     "the largest part is `intermediate_size` (2147483647) * `hidden_size` (1048576) (MLP layers)"),
    ({"vocab_size": 2**31 - 1, "hidden_size": 2**20}, "the largest part is `vocab_size` (2147483647) * `hidden_size`"),
    ({"n_routed_experts": 2**16, "moe_intermediate_size": 2**30, "hidden_size": 2**30},
     "the largest part is `n_routed_experts` (65536) * `moe_intermediate_size` (1073741824) * `hidden_size`"),
])
def test_config_sizes_beyond_the_bounds_fail_fast_naming_file_and_field(single, tmp_path, change, message):
    import time

    d = _copy(single, tmp_path)
    _edit_config(d, **change)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        hybrid.load_model(d, progress=False)
    assert time.perf_counter() - start < 1.0
    assert str(info.value).startswith(f"{d / 'config.json'}: ") and message in str(info.value)


def test_build_model_bounds_a_config_built_in_python():
    from hybrid.config import HybridConfig
    from hybrid.loading import build_model
    from tiny_checkpoint import TINY

    config = HybridConfig(hybrid_override_pattern="M*E-", **{**TINY, "n_routed_experts": 2**31 - 1})
    with pytest.raises(ConfigError, match="`n_routed_experts` is 2,147,483,647; at most 65,536"):
        build_model(config, torch.float32)


def _safetensors(path, header, data: bytes = b"\0" * 8):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, data, message", [
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "tensor 'w' has no data_offsets"),
    ({"w": 5}, b"\0" * 8, "tensor 'w' is 5; expected an object with dtype, shape and data_offsets"),
    ({"w": {**F32x2, "dtype": "F7"}}, b"\0" * 8, "tensor 'w' has dtype 'F7'; expected one of ['BF16', 'BOOL',"),
    ({"w": {**F32x2, "dtype": ["F32"]}}, b"\0" * 8, "tensor 'w' has dtype ['F32']; expected one of ['BF16',"),
    ({"w": {**F32x2, "shape": [-2]}}, b"\0" * 8, "tensor 'w' has shape [-2]; expected a list of integers >= 0"),
    ({"w": {**F32x2, "shape": "2"}}, b"\0" * 8, "tensor 'w' has shape '2'; expected a list of integers >= 0"),
    ({"w": {**F32x2, "shape": [2.0]}}, b"\0" * 8, "tensor 'w' has shape [2.0]; expected a list of integers >= 0"),
    ({"w": {**F32x2, "shape": [True, 2]}}, b"\0" * 8, "tensor 'w' has shape [True, 2]; expected a list of integers"),
    ({"w": {**F32x2, "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}, b"\0" * 8,
     "tensor 'w' has shape [0, 4611686018427387904, 4611686018427387904], too large for torch"),
    ({"w": {**F32x2, "data_offsets": [0, 800]}}, b"\0" * 8,
     "tensor 'w' has data_offsets [0, 800]; expected [begin, end] with 0 <= begin <= end <= 8"),
    ({"w": {**F32x2, "data_offsets": [8, 0]}}, b"\0" * 8,
     "tensor 'w' has data_offsets [8, 0]; expected [begin, end] with 0 <= begin <= end <= 8"),
    ({"w": {**F32x2, "data_offsets": ["0", 8]}}, b"\0" * 8,
     "tensor 'w' has data_offsets ['0', 8]; expected [begin, end] with 0 <= begin <= end <= 8"),
    ({"w": {**F32x2, "data_offsets": [0, 8, 8]}}, b"\0" * 8,
     "tensor 'w' has data_offsets [0, 8, 8]; expected [begin, end] with 0 <= begin <= end <= 8"),
    ({"w": {**F32x2, "data_offsets": [0, 4]}}, b"\0" * 8,
     "tensor 'w' has data_offsets [0, 4] (4 bytes), but shape [2] of F32 needs 8 bytes"),
    ({"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}, b"\0" * 12,
     "tensors 'a' and 'b' overlap (data_offsets [0, 8] and [4, 12])"),
    ([1, 2], b"", "safetensors header is not a JSON object (got list)"),
    ({"__metadata__": [1], "w": F32x2}, b"\0" * 8, "__metadata__ must be an object of strings, got [1]"),
    (b"{nope", b"", "unreadable safetensors header ("),
    (b"[" * 100_000, b"", "unreadable safetensors header (nested too deeply)"),
    (b"{\"w\": " + b"1" * 5000 + b"}", b"", "unreadable safetensors header (Exceeds the limit"),
])
def test_crafted_safetensors_header(tmp_path, header, data, message):
    from hybrid.checkpoint_files import SafetensorsFile

    path = _safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_header_length_larger_than_the_file(tmp_path):
    from hybrid.checkpoint_files import SafetensorsFile

    path = tmp_path / "model.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(info.value) == f"{path}: not a safetensors file (header length 1000000 exceeds the file size 10)"


def test_valid_crafted_file_loads_every_tensor(tmp_path):
    from hybrid.checkpoint_files import SafetensorsFile

    data = torch.tensor([1.5, -2.0]).numpy().tobytes() + b"\x07"
    f = SafetensorsFile(_safetensors(tmp_path / "x.safetensors", {
        "__metadata__": {"format": "pt"}, "w": F32x2, "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [8, 8]},
        "b": {"dtype": "U8", "shape": [], "data_offsets": [8, 9]}}, data))
    assert f.metadata == {"format": "pt"} and f.keys() == ["w", "e", "b"]
    assert f.view("w").tolist() == [1.5, -2.0] and f.view("e").shape == (0, 3) and f.view("b").item() == 7


@pytest.mark.parametrize("index, message", [
    ("[1, 2", "unreadable index ("),
    ("[1, 2]", "expected a JSON object with a `weight_map`, got list"),
    ("{}", "has no `weight_map`"),
    ('{"weight_map": [1]}', "`weight_map` must be an object of tensor name -> shard file name, got [1]"),
    ('{"weight_map": {"w": 1}}', "`weight_map` must be an object of tensor name -> shard file name, got {'w': 1}"),
    ('{"weight_map": {"w": "../outside.safetensors"}}',
     "shard '../outside.safetensors' of tensor 'w' is not a file name in the checkpoint directory"),
    ('{"weight_map": {"w": "sub/model.safetensors"}}',
     "shard 'sub/model.safetensors' of tensor 'w' is not a file name in the checkpoint directory"),
    ('{"weight_map": {"w": "/etc/passwd"}}', "shard '/etc/passwd' of tensor 'w' is not a file name in the checkpoint"),
    ('{"weight_map": {"w": ".."}}', "shard '..' of tensor 'w' is not a file name in the checkpoint directory"),
    ('{"weight_map": {"w": "a\\\\b"}}', "shard 'a\\\\b' of tensor 'w' is not a file name in the checkpoint directory"),
    ('{"weight_map": {"w": "nope.safetensors"}}', "lists shard(s) missing from"),
])
def test_crafted_index(tmp_path, index, message):
    from hybrid.checkpoint_files import CheckpointFiles

    d = tmp_path / "ckpt"
    d.mkdir()
    _safetensors(tmp_path / "outside.safetensors", {"w": F32x2})  # what `..` would reach
    (d / "sub").mkdir()
    _safetensors(d / "sub" / "model.safetensors", {"w": F32x2})
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError) as info:
        CheckpointFiles(d)
    assert str(info.value).startswith(f"{d / 'model.safetensors.index.json'}: {message}")


ID = "a token id (an integer in [0, 2^31))"  # as config.json checks it (`hybrid.config.TOKEN_IDS`)


@pytest.mark.parametrize("name, content, message", [
    ("generation_config.json", '{"eos_token_id": "x"}',
     f"`eos_token_id` must be {ID}, a list of them, or null, got 'x'"),
    ("generation_config.json", '{"eos_token_id": [{"a": 1}]}',
     f"`eos_token_id` must be {ID}, a list of them, or null, got [{{'a': 1}}]"),
    ("generation_config.json", '{"eos_token_id": 1.5}',
     f"`eos_token_id` must be {ID}, a list of them, or null, got 1.5"),
    ("generation_config.json", '{"pad_token_id": "0"}', f"`pad_token_id` must be {ID} or null, got '0'"),
    # before: "Overflow when unpacking long long", naming neither file nor key
    ("generation_config.json", '{"eos_token_id": ' + str(10**30) + '}',
     f"`eos_token_id` must be {ID}, a list of them, or null, got {10**30}"),
    ("generation_config.json", '{"eos_token_id": [2, 2147483648]}',
     f"`eos_token_id` must be {ID}, a list of them, or null, got [2, 2147483648]"),
    ("generation_config.json", '{"pad_token_id": ' + str(2**31) + '}', f"`pad_token_id` must be {ID} or null, got {2**31}"),
    ("generation_config.json", "[" * 5000, "not valid JSON (nested too deeply)"),
    ("generation_config.json", '{"x": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
    ("tokenizer_config.json", b'{"x": "\xff"}', "not valid JSON ("),
    ("chat_template.jinja", b"{{ '\xff' }}", "not valid UTF-8 ("),
    ("tokenizer_config.json", '{"chat_template": 5}', "`chat_template` must be a string or a list of {name, template} "
                                                     "objects, got 5"),  # before: "no chat template" at use
])
def test_tokenizer_files_with_bad_values(single, tmp_path, name, content, message):
    """Before: ValueError / TypeError from int(), RecursionError, UnicodeDecodeError, not CheckpointError."""
    d = _copy(single, tmp_path)
    (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError) as info:
        hybrid.load(d, progress=False)
    assert str(info.value).startswith(f"{d / name}: {message}")


@pytest.mark.parametrize("tokenizer_config", [
    {"chat_template": [1, {"name": ["default"]}, {"name": "default", "template": 5}]},  # before: AttributeError
    {"eos_token": {"content": 5}, "pad_token": ["<pad>"]},  # before: TypeError from token_to_id(5)
])
def test_malformed_optional_tokenizer_entries_are_ignored(single, tmp_path, tokenizer_config):
    d = _copy(single, tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _, tok = hybrid.load(d, progress=False)
    assert tok.chat_template is None and tok.stop_ids == [2, 4]  # eos 4 from special_tokens_map.json


@pytest.mark.parametrize("key, value", [
    ("blocks", "[" * 5000),  # nested too deeply: RecursionError
    ("blocks", "[" + "1" * 5000 + "]"),  # an integer of more than 4300 digits: ValueError
    ("snapshots", "[" * 5000),
    ("snapshots", '[{"parent": -1, "tail": [' + "1" * 5000 + "]}]"),
])
def test_prefix_cache_file_with_a_crafted_entry_list(single, tmp_path, key, value):
    """Before: RecursionError / ValueError (integer of more than 4300 digits) instead of PrefixCacheFileError."""
    from hybrid.prefix_cache import PrefixCache, PrefixCacheFileError

    cache = PrefixCache(hybrid.load_model(single, progress=False), snapshot_interval=16)
    path = tmp_path / "cache.safetensors"
    meta = {"format": "hybrid-prefix-cache", "version": "2", "identity": cache.identity, "block_size": "16",
            "blocks": "[]", "snapshots": "[]", key: value}
    save_file({"x": torch.zeros(1)}, path, metadata=meta)
    with pytest.raises(PrefixCacheFileError) as info:
        cache.load(path)
    assert str(info.value) == f"{path}: its {key} list (metadata {key!r}) is not JSON"
    assert len(cache) == 0


@pytest.mark.parametrize("content, message", [
    ("[" * 5000, "not valid JSON (nested too deeply)"),
    ('{"x": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
])
def test_crafted_hf_quant_config(single, tmp_path, content, message):
    """Before: RecursionError / ValueError from json.loads instead of CheckpointError."""
    d = _copy(single, tmp_path)
    (d / "hf_quant_config.json").write_text(content)
    with pytest.raises(CheckpointError) as info:
        hybrid.load_model(d, progress=False)
    assert f"{d / 'hf_quant_config.json'}: {message}" in str(info.value)


@pytest.mark.parametrize("exclude", [[1, 2], "lm_head", [["lm_head"]]])
def test_exclusions_that_are_not_name_patterns(single, tmp_path, exclude):
    """Before: [1, 2] passed `info` and failed later inside fnmatch with a misleading TypeError."""
    d = _copy(single, tmp_path)
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "exclude_modules": exclude}}))
    with pytest.raises(CheckpointError, match="exclude_modules must be a list of module name patterns"):
        hybrid.load_model(d, progress=False)


CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block", "dynamic": False}}


@pytest.mark.parametrize("block, message", [
    ({"format": ["float-quantized"], "config_groups": {"group_0": CT_GROUP}},
     "config_groups.group_0: compressed-tensors format ['float-quantized'] is not supported"),
    ({"format": "float-quantized", "config_groups": {"group_0": {
        **CT_GROUP, "weights": {**CT_GROUP["weights"], "block_structure": "x"}}}},
     "config_groups.group_0: block_structure 'x' must be [n, n] with n a positive integer"),
    ({"format": "float-quantized", "config_groups": {"group_0": {
        **CT_GROUP, "weights": {**CT_GROUP["weights"], "block_structure": ["a", "a"]}}}},
     "config_groups.group_0: block_structure ['a', 'a'] must be [n, n] with n a positive integer"),
])
def test_crafted_compressed_tensors_block(single, tmp_path, block, message):
    """Before: TypeError (unhashable format, len() of a non-list) or ValueError (int('a'))."""
    d = _copy(single, tmp_path)
    _edit_config(d, quantization_config={"quant_method": "compressed-tensors", **block})
    with pytest.raises(CheckpointError) as info:
        hybrid.load_model(d, progress=False)
    assert str(info.value).startswith(f"quantized checkpoint: {d / 'config.json'} (quantization_config): {message}")


def test_single_file_wins_over_an_index_with_a_warning(single, sharded, tmp_path):
    """Before: the index was read silently; transformers reads model.safetensors."""
    from hybrid.checkpoint_files import CheckpointFiles

    d = _copy(sharded, tmp_path)
    shutil.copy(single / "model.safetensors", d / "model.safetensors")
    with pytest.warns(UserWarning, match=r"holds both model.safetensors and model.safetensors.index.json; loading "
                                         r"model.safetensors \(as transformers does\)"):
        files = CheckpointFiles(d)
    assert list(files.files) == ["model.safetensors"] and set(files.keys()) == set(load_file(single / "model.safetensors"))


def test_cli_notes_a_single_file_next_to_an_index(single, sharded, tmp_path, capsys):
    from hybrid.cli import main

    d = _copy(sharded, tmp_path)
    shutil.copy(single / "model.safetensors", d / "model.safetensors")
    assert main(["generate", str(d), "--prompt", "hi", "--max-new-tokens", "1"]) == 0
    assert "note: " + str(d) + ": holds both model.safetensors and model.safetensors.index.json" in capsys.readouterr().err


@pytest.mark.parametrize("name, what", [
    ("model.safetensors", "a safetensors weights file"),
    ("tokenizer.json", "not a config (tokenizer.json)"),
])
def test_info_on_a_file_that_is_no_config_says_what_it_takes(single, capsys, name, what):
    """Before: "model.safetensors: not valid JSON (...)"."""
    from hybrid.cli import main

    assert main(["info", str(single / name)]) == 2
    assert capsys.readouterr().err == (f"error: {single / name} is {what}; `hybrid info` takes a checkpoint "
                                       "directory or a config.json\n")
    assert main(["info", str(single / "config.json")]) == 0
