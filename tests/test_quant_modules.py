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
from moe.quant import PackedExperts, PackedWeight, QuantLinear, formats, kernels
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


# ------------------------------------------------------------------ experts held one at a time (PackedExperts)
def _stack(fmt_name: str, E: int = 4, out_f: int = 64, in_f: int = 96) -> PackedWeight:
    fmt = formats.MODELOPT_ALGOS[fmt_name]
    stack = PackedWeight(fmt, out_f, in_f, n_experts=E)
    w = torch.randn(E, out_f, in_f, generator=torch.Generator().manual_seed(1))
    for name, t in fmt.quantize(w, torch.rand(E) + 0.5 if fmt.layout.input_scale else None).items():
        getattr(stack, name).copy_(t)
    return stack


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt_name", ["FP8", "NVFP4", "MXFP4"])
def test_packed_experts_is_the_stack_held_per_expert(fmt_name):
    stack = _stack(fmt_name)
    parts = [{n: t[e].clone() for n, t in stack.named_buffers()} for e in range(stack.n_experts)]
    experts = PackedExperts(stack.fmt, stack.out_features, stack.in_features, parts)
    assert experts.nbytes() == stack.nbytes() and experts.numel == stack.numel
    for e in range(stack.n_experts):
        assert torch.equal(experts.dequantize(expert=e), stack.dequantize(expert=e))
        mine, theirs = experts.expert(e), stack.expert(e)
        assert mine.keys() == theirs.keys() and all(_same_bytes(mine[r], theirs[r]) for r in mine)
    assert torch.equal(experts.dequantize(), stack.dequantize())
    mine, theirs = experts.state_dict(), stack.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].shape == theirs[k].shape and _same_bytes(mine[k], theirs[k]) for k in mine)
    for (n1, s1, d1, p1), (n2, s2, d2, p2) in zip(experts.tensor_pieces(), stack.tensor_pieces(), strict=True):
        joined = torch.cat([p.reshape(-1).view(torch.uint8) for p in p1])
        assert (n1, s1, d1) == (n2, s2, d2) and torch.equal(joined, next(p2).reshape(-1).view(torch.uint8))
    if (cpu := kernels.cpu_for(torch.zeros(1, 96), stack.fmt)) is not None:  # the kernels read either form alike
        xs = [torch.randn(r, 96, generator=torch.Generator().manual_seed(r)) for r in (1, 3, 1)]
        for a, b in zip(cpu.linear_group(xs, experts, [2, 0, 3]), cpu.linear_group(xs, stack, [2, 0, 3])):
            assert torch.equal(a, b)
    if stack.fmt.layout.input_scale:
        assert torch.equal(experts.activation_scale(1), stack.activation_scale(1))


def test_packed_experts_checks_and_replaces_its_tensors():
    stack = _stack("NVFP4")
    parts = [{n: t[e] for n, t in stack.named_buffers()} for e in range(stack.n_experts)]
    data = stack.fmt.names["data"]
    with pytest.raises(ValueError, match=r"expert 2 has tensors .* needs"):
        PackedExperts(stack.fmt, 64, 96, parts[:2] + [{k: v for k, v in parts[2].items() if k != data}])
    with pytest.raises(ValueError, match=rf"expert 1's {data} is torch.uint8 \[64, 40\]"):
        PackedExperts(stack.fmt, 64, 96, [parts[0], {**parts[1], data: torch.zeros(64, 40, dtype=torch.uint8)}])
    experts = PackedExperts(stack.fmt, 64, 96, parts)
    with pytest.raises(RuntimeError, match="expert\\(e\\)"):
        experts.role("data")
    with pytest.raises(RuntimeError, match="load it on the device you need"):
        experts.to("meta")
    other = _stack("NVFP4", in_f=96)
    other.weight.data ^= 0x11  # other codes
    experts.load_state_dict(other.state_dict())
    assert torch.equal(experts.dequantize(), other.dequantize())
    with pytest.raises(RuntimeError, match="size mismatch"):
        experts.load_state_dict({k: v[:2] for k, v in other.state_dict().items()})


def _maps_of(path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of file `path` (/proc/self/maps)."""
    out = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_a_cpu_load_maps_the_packed_experts(quantized, fmt):
    """The experts' packed tensors are views of the checkpoint's memory map (no copy), read as the file holds
    them, and so are the embeddings and packed linears; without mmap they are copies; both give the stacked
    bank's logits and the same identity."""
    model = hybrid.load_model(quantized[fmt], dtype="bf16")
    bank = model.backbone.layers[1].mixer.experts
    assert isinstance(bank.up_proj, PackedExperts) and isinstance(bank.down_proj, PackedExperts)
    maps = _maps_of((quantized[fmt] / "model.safetensors").resolve())
    with safe_open(quantized[fmt] / "model.safetensors", "pt") as f:
        for e in (0, 5, 15):
            for name, t in bank.up_proj.experts[e].items():
                assert _same_bytes(t, f.get_tensor(f"backbone.layers.1.mixer.experts.{e}.up_proj.{name}"))
                assert any(lo <= t.data_ptr() < hi for lo, hi in maps), (e, name)
    # so are the other tensors stored as the model holds them: the embeddings, the packed linears' bytes
    kept = [model.backbone.embeddings.weight] + [t for _, t in model.named_buffers() if t.element_size() == 1]
    assert len(kept) > 1 and all(any(lo <= t.data_ptr() < hi for lo, hi in maps) for t in kept)
    assert not any(p.requires_grad for p in model.parameters())  # read-only memory: for inference
    copied = hybrid.load_model(quantized[fmt], dtype="bf16", mmap=False)
    t = copied.backbone.layers[1].mixer.experts.up_proj.experts[3]["weight"]
    kept = [copied.backbone.embeddings.weight] + [u for _, u in copied.named_buffers() if u.element_size() == 1]
    assert not any(lo <= u.data_ptr() < hi for lo, hi in maps for u in [t] + kept)
    stacked = hybrid.load_model(quantized[fmt], dtype="bf16")
    for name, m in list(stacked.named_modules()):
        if isinstance(m, QuantExpertBank):  # the same experts, as [E, ...] stacks
            fresh = QuantExpertBank(m.n_experts, m.up_proj.in_features, m.up_proj.out_features, m.up_proj.fmt,
                                    m.down_proj.fmt, torch.bfloat16)
            fresh.load_state_dict(m.state_dict())
            assert not isinstance(fresh.up_proj, PackedExperts)
            parent, _, child = name.rpartition(".")
            setattr(stacked.get_submodule(parent), child, fresh)
    ids = torch.randint(5, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = stacked(ids)
        assert torch.equal(model(ids), want) and torch.equal(copied(ids), want)
    assert model.identity == copied.identity == stacked.identity
