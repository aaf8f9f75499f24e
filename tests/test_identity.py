"""Model identity (`HybridForCausalLM.identity`): taken on first use from every byte of the weights; the same for
the same numbers however the model came to be (loaded, built in memory, prepacked in either form); different
whenever one weight element, the dtype, quantization or act_quant differ; invalidated by `load_state_dict`;
never stacking a prepacked expert bank."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybrid
from hybrid.quantize import quantize_model
from moe.quant.kernels.prepacked import PrepackedExpertBank
from moe.quant.kernels import bf16, onednn
from tiny_checkpoint import random_model, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ident"), pattern="ME*E", seed=7, n_routed_experts=8)


def test_loaded_and_in_memory_models_agree(tmp_path):
    """The digest taken from the loaded tensors equals the one an in-memory model takes from its own."""
    model = random_model("ME*E", seed=7, n_routed_experts=8)
    hybrid.save_checkpoint(model, tmp_path)
    assert hybrid.load_model(tmp_path).identity == model.identity


def _with_one_element_changed(source, tmp_path, name, index, bf16_step: bool):
    """A copy of fp32 checkpoint `source` in `tmp_path` with one element of tensor `name` changed: by one fp32
    ulp, or by one bf16 ulp (smaller changes vanish when the model is loaded in bf16: the same numbers)."""
    tensors = load_file(source / "model.safetensors")
    t = tensors[name].clone()
    x = t[index].to(torch.bfloat16) if bf16_step else t[index]
    t[index] = torch.nextafter(x, x + 1).float()
    tensors[name] = t
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_element_in_the_middle_of_an_expert_bank_changes_the_identity(source, tmp_path, dtype):
    """One element (one ulp of the model dtype) in the middle of expert 5 of one bank: every byte is read."""
    name = "backbone.layers.1.mixer.experts.5.down_proj.weight"
    shape = load_file(source / "model.safetensors")[name].shape
    changed = _with_one_element_changed(source, tmp_path, name, (shape[0] // 2, shape[1] // 2), dtype == "bf16")
    assert hybrid.load_model(changed, dtype=dtype).identity != hybrid.load_model(source, dtype=dtype).identity
    assert hybrid.load_model(source, dtype=dtype).identity == hybrid.load_model(source, dtype=dtype).identity


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


@pytest.mark.parametrize("form", ["plain", "onednn"])
def test_a_prepacked_model_names_itself_as_the_plain_one(source, monkeypatch, form):
    """Either stored form gives the identity of the unpacked model, and no expert bank is stacked for it."""
    if form == "onednn":
        if not onednn.available():
            pytest.skip("no oneDNN bf16 on this CPU / PyTorch build")
        monkeypatch.setattr(bf16, "plain_kernel", lambda: None)
    elif bf16.plain_kernel() is None:
        pytest.skip("no bf16 dot-product kernel on this CPU")
    plain = hybrid.load_model(source, dtype="bf16", prepack=False)

    def refuse(self, name):
        raise AssertionError("the identity stacked a prepacked expert bank")

    monkeypatch.setattr(PrepackedExpertBank, "dense_tensor", refuse)
    packed = hybrid.load_model(source, dtype="bf16")
    assert any(isinstance(m, PrepackedExpertBank) for m in packed.modules())
    assert packed.identity == plain.identity
