"""Model identity (`HybridForCausalLM.identity`): taken once, at load, from the tensors as read; the same for the
same numbers however the model came to be; different whenever weights, dtype, quantization or act_quant
differ; invalidated by `load_state_dict`; never densifying prepacked weights."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybrid
from hybrid.quantize import quantize_model
from moe.quant import Prepacked
from moe.quant.kernels import onednn
from tiny_checkpoint import random_model, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ident"), pattern="ME*E", seed=7, n_routed_experts=8)


def test_loaded_and_in_memory_models_agree(tmp_path):
    """The digest taken from the loaded tensors equals the one an in-memory model takes from its own."""
    model = random_model("ME*E", seed=7, n_routed_experts=8)
    hybrid.save_checkpoint(model, tmp_path)
    assert hybrid.load_model(tmp_path).identity == model.identity


def test_one_changed_expert_changes_the_identity(source, tmp_path):
    """Only expert 5 of one layer differs (in a single row): the sample reads every expert's bytes."""
    tensors = load_file(source / "model.safetensors")
    name = "backbone.layers.1.mixer.experts.5.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][7] += 0.25
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert hybrid.load_model(tmp_path).identity != hybrid.load_model(source).identity
    assert hybrid.load_model(source).identity == hybrid.load_model(source).identity


def test_dtype_quantization_and_act_quant_change_the_identity(source, tmp_path):
    fp32, bf16 = hybrid.load_model(source, dtype="fp32"), hybrid.load_model(source, dtype="bf16")
    fp8 = quantize_model(hybrid.load_model(source, dtype="bf16"), "fp8", exclude=["lm_head"])
    hybrid.save_checkpoint(fp8, tmp_path)
    weight_only, act_quant = hybrid.load_model(tmp_path), hybrid.load_model(tmp_path, act_quant=True)
    ids = {fp32.identity, bf16.identity, fp8.identity, weight_only.identity, act_quant.identity}
    assert len(ids) == 5


def test_load_state_dict_takes_the_identity_of_what_it_loads(source):
    model, other = hybrid.load_model(source), random_model("ME*E", seed=8, n_routed_experts=8)
    before = model.identity
    model.load_state_dict(other.state_dict())
    assert model.identity == other.identity != before
    state = model.state_dict()
    state["backbone.norm_f.weight"] = state["backbone.norm_f.weight"] * 2
    model.load_state_dict({"backbone.norm_f.weight": state["backbone.norm_f.weight"]}, strict=False)
    assert model.identity not in (other.identity, before)  # a partial load: retaken from the current tensors
    with torch.no_grad():
        model.backbone.norm_f.weight.copy_(other.backbone.norm_f.weight)
    model.reset_identity()  # after an in-place edit
    assert model.identity == other.identity


@pytest.mark.skipif(not onednn.available(), reason="no oneDNN bf16 on this CPU / PyTorch build")
def test_a_prepacked_model_names_itself_without_dense_copies(source, monkeypatch):
    plain = hybrid.load_model(source, dtype="bf16", prepack=False)

    def refuse(self):
        raise AssertionError("the identity densified a prepacked weight")

    monkeypatch.setattr(Prepacked, "dense_tensors", refuse)
    packed = hybrid.load_model(source, dtype="bf16")
    assert any(isinstance(m, Prepacked) for m in packed.modules())
    assert packed.identity == plain.identity
