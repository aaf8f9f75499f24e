"""Packed modules: resident memory is the packed size, only the selected experts are ever dequantized, the
packed forward equals the forward with dequantized weights, dtype casts leave packed tensors alone."""

import pytest
import torch
from safetensors import safe_open

import hybrid
from hybrid.accounting import resident_bytes
from hybrid.quantize import quantize_model
from hybrid.saving import save_checkpoint
from moe.experts import ExpertBank, QuantExpertBank
from moe.quant import PackedWeight, QuantLinear, kernels
from moe.quant.config import modelopt_format
from tiny_checkpoint import write_checkpoint

BIG = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
           head_dim=16, mamba_head_dim=16, n_routed_experts=16, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qsrc"), pattern="ME*E", seed=3, **BIG)


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """{format: directory} written by quantize_model + save_checkpoint (bf16 for the unquantized tensors)."""
    out = {}
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        model = hybrid.load_model(source, dtype="bf16")
        ids = torch.randint(5, 300, (1, 24), generator=torch.Generator().manual_seed(0))
        quantize_model(model, fmt, exclude=["lm_head", "backbone.embeddings"], calibration=[ids])
        out[fmt] = save_checkpoint(model, tmp_path_factory.mktemp(fmt))
    return out


def _file_bytes(directory) -> int:
    total = 0
    with safe_open(directory / "model.safetensors", "pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            n = 1
            for d in s.get_shape():
                n *= d
            total += n * {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F32": 4}[s.get_dtype()]
    return total


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_resident_weight_bytes_are_the_packed_size(quantized, source, fmt):
    model = hybrid.load_model(quantized[fmt], dtype="bf16")
    resident, packed = resident_bytes(model), _file_bytes(quantized[fmt])
    assert abs(resident - packed) <= 0.05 * packed, (resident, packed)
    dense = resident_bytes(hybrid.load_model(source, dtype="bf16"))
    # the experts dominate this model: FP8 about halves the bf16 bytes, FP4 about quarters them
    assert resident < {"fp8": 0.62, "nvfp4": 0.4, "mxfp4": 0.4}[fmt] * dense, (resident, dense)


def test_a_forward_dequantizes_only_the_selected_experts(quantized, monkeypatch):
    """The PyTorch reference path (prefill chunks of more than 16 rows, or no compiled kernels)."""
    monkeypatch.setattr(kernels, "cpu_for", lambda x, fmt: None)
    model = hybrid.load_model(quantized["nvfp4"], dtype="fp32")
    bank = model.backbone.layers[1].mixer.experts
    assert isinstance(bank, QuantExpertBank)
    calls = []
    plain = PackedWeight.dequantize

    def spy(self, dtype=torch.float32, expert=None):
        out = plain(self, dtype, expert)
        calls.append((self, expert, tuple(out.shape)))
        return out

    monkeypatch.setattr(PackedWeight, "dequantize", spy)
    T, L = 5, 64
    x = torch.randn(T, L)
    ids = torch.tensor([[3, 7], [7, 3], [3, 11], [7, 11], [11, 3]])
    weights = torch.rand(T, 2)
    bank(x, weights, ids)
    assert {e for _, e, _ in calls} == {3, 7, 11}  # never None: the whole stack is never built
    assert all(shape in ((64, 64),) for _, _, shape in calls)
    assert len(calls) == 6  # one up and one down per selected expert

    # Memory, measured by the profiler: no allocation is larger than one expert's fp32 weight times two (the
    # int64 gather index aten::index builds while decoding one expert's codes); the bank's 16 experts
    # dequantized together would be 8 times that.
    monkeypatch.setattr(PackedWeight, "dequantize", plain)
    one_expert_fp32 = 64 * 64 * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        bank(x, weights, ids)
    biggest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert one_expert_fp32 <= biggest <= 2 * one_expert_fp32, biggest


def _densify(model):
    """The same model with every packed module replaced by its float equivalent (dequantized weights)."""
    for name, mod in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if isinstance(mod, QuantLinear):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            lin.weight.data = mod.dequantize(torch.float32)
            setattr(model.get_submodule(parent), child, lin)
        elif isinstance(mod, QuantExpertBank):
            bank = ExpertBank(mod.n_experts, mod.up_proj.in_features, mod.up_proj.out_features)
            bank.up_proj.data, bank.down_proj.data = mod.up_proj.dequantize(), mod.down_proj.dequantize()
            setattr(model.get_submodule(parent), child, bank)
    return model


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_packed_forward_equals_dequantized_forward(quantized, fmt, monkeypatch):
    ids = torch.randint(5, 300, (2, 17), generator=torch.Generator().manual_seed(4))
    packed = hybrid.load_model(quantized[fmt], dtype="fp32")
    dense = _densify(hybrid.load_model(quantized[fmt], dtype="fp32"))
    assert not any(isinstance(m, PackedWeight) for m in dense.modules())
    with torch.no_grad():
        want = dense(ids)
        got = packed(ids)  # from the packed bytes (moe.quant.kernels.cpu): fp32 sums in another order
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    monkeypatch.setattr(kernels, "cpu_for", lambda x, fmt: None)  # the PyTorch path: the dense model's operations
    torch.testing.assert_close(packed(ids), want, rtol=1e-6, atol=1e-5)


def test_activation_quantization_emulation():
    lin = torch.nn.Linear(64, 32)
    fmt = modelopt_format("FP8")
    q = QuantLinear.from_linear(lin, fmt, torch.tensor(4.48))  # input_scale = 4.48 / 448 = 0.01
    assert q.input_scale.item() == pytest.approx(0.01)
    x = torch.randn(3, 64)
    q.act_quant = True
    xq = (x / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.01
    torch.testing.assert_close(q(x), torch.nn.functional.linear(xq, q.dequantize(), q.bias), rtol=0, atol=1e-6)
    q.act_quant = False
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.dequantize(), q.bias), rtol=0, atol=1e-6)


def test_cast_keeps_packed_dtypes(quantized):
    model = hybrid.load_model(quantized["nvfp4"], dtype="fp32")
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items() if v.dtype in (torch.uint8, torch.float8_e4m3fn)}
    model.cast(torch.bfloat16)
    sd = model.state_dict()
    assert sd["backbone.layers.0.mixer.in_proj.weight_scale_2"].dtype == torch.float32
    assert sd["backbone.layers.0.mixer.in_proj.input_scale"].dtype == torch.float32
    assert sd["backbone.norm_f.weight"].dtype == torch.bfloat16
    for k, (dtype, t) in before.items():
        assert sd[k].dtype == dtype and torch.equal(sd[k].view(torch.uint8), t.view(torch.uint8)), k
