"""Prepacked bf16 linears (`moe.prepack`, `moe.quant.kernels.prepacked`, `moe.quant.kernels.bf16`) against the plain
modules they replace, in both stored forms: the plain copy for this project's dot-product kernel (decode
rows; PyTorch's matmul for more) and oneDNN's blocked layout.

Oracles: the fp32 product of the same bf16 operands (a packed product may differ from it only by the bf16
rounding of its output and the summation order), the unpacked `ExpertBank`, and the same checkpoint loaded
with `prepack=False` (identical state dict and fingerprint; logits equal up to that rounding; the default
checkpoint's greedy tokens identical).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybrid
from hybrid.accounting import resident_bytes
from hybrid.checkpoint_files import CheckpointFiles
from hybrid.cli import DEFAULT_CHECKPOINT
from hybrid.generate import generate_ids
from moe.experts import ExpertBank
from moe.prepack import prepack, unpack
from moe.quant.kernels import bf16, onednn
from moe.quant.kernels.experts import dispatch
from moe.quant.kernels.prepacked import PrepackedExpertBank, PrepackedLinear

pytestmark = pytest.mark.skipif(not bf16.available(), reason="no bf16 kernels on this CPU / PyTorch build")
FORMS = ["plain", "onednn"]


@pytest.fixture(params=FORMS)
def form(request, monkeypatch):
    """Each test runs with weights stored in each form (the plain form needs the kernel, oneDNN its bf16)."""
    if request.param == "plain" and bf16.plain_kernel() is None:
        pytest.skip("the bf16 dot-product kernel is not built for this CPU")
    if request.param == "onednn":
        if not onednn.available():
            pytest.skip("no oneDNN bf16 on this CPU / PyTorch build")
        monkeypatch.setattr(bf16, "plain_kernel", lambda: None)
    return request.param


def _form_of(packed: torch.Tensor) -> str:
    return "onednn" if packed.is_mkldnn else "plain"


def _assert_bf16_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """got (bf16) equals the fp32 reference up to a couple of bf16 roundings of its magnitude."""
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = (got.float() - ref).abs()
    assert float(err.max()) <= 2 ** -7 * float(ref.abs().max()) + 1e-3, float(err.max())


@pytest.mark.parametrize("shape", [(1, 100), (3, 100), (2, 5, 100), (40, 100)])  # 40 rows: past DECODE_ROWS
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp32_product(form, shape, bias):
    torch.manual_seed(0)
    source = nn.Linear(100, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    packed = PrepackedLinear(source)
    assert _form_of(packed.packed) == form
    ref = x.float() @ source.weight.float().T + (source.bias.float() if bias else 0)
    with torch.inference_mode():
        _assert_bf16_close(packed(x), ref)
    assert torch.equal(packed.weight, source.weight)
    assert list(packed.state_dict()) == list(source.state_dict())
    assert all(torch.equal(packed.state_dict()[k], source.state_dict()[k]) for k in source.state_dict())


def test_prefill_tiles_equal_the_exact_product(monkeypatch):
    """Inputs past `DECODE_ROWS` on a plain weight where PyTorch has no fast bf16 GEMM (AVX2): fp32 GEMMs over
    tiles of the weight (here 7 rows a tile, the last one short), the fp32 sums of exact products."""
    if bf16.plain_kernel() is None:
        pytest.skip("the bf16 dot-product kernel is not built for this CPU")
    monkeypatch.setattr(bf16, "PREFILL_TILE_BYTES", 7 * 4 * 100)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 100, generator=g).bfloat16(), torch.randn(33, 100, generator=g).bfloat16()
    got = bf16._fp32_tiles(x, w)
    ref = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (33, 40) and got.is_contiguous()
    assert bool(((got.double() - ref).abs() <= 2e-6 * (x.double().abs() @ w.double().abs().T)).all())
    # through `linear`: bf16, laid out as [..., out] row-major (what attention and the norms read best)
    y = bf16.linear(x.reshape(3, 11, 100), w, relu=True)
    assert y.shape == (3, 11, 40) and y.is_contiguous() and y.dtype == torch.bfloat16
    if not bf16.plain_kernel().bf16_inputs():  # these very tiles (elsewhere PyTorch's bf16 GEMM)
        assert torch.equal(y, got.relu().to(torch.bfloat16).reshape(3, 11, 40))


def test_packed_expert_bank_matches_bank(form):
    torch.manual_seed(1)
    bank = ExpertBank(6, 32, 48).to(torch.bfloat16)
    with torch.no_grad():
        bank.up_proj.normal_(0, 0.2)
        bank.down_proj.normal_(0, 0.2)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    packed = PrepackedExpertBank(bank)
    assert {_form_of(w) for w in packed.up + packed.down} == {form}
    with torch.inference_mode():
        # fp32 reference of the same bf16 operands: y_t = sum_j w_tj * down_e(relu(up_e(x_t))^2)
        ref = torch.zeros(9, 32)
        for t in range(9):
            for j in range(2):
                e = int(ids[t, j])
                u = torch.relu(x[t].float() @ bank.up_proj[e].float().T).square().bfloat16().float()
                ref[t] += weights[t, j] * (u @ bank.down_proj[e].float().T)
        _assert_bf16_close(packed(x, weights, ids), ref)
        _assert_bf16_close(packed(x[:1], weights[:1], ids[:1]), ref[:1])  # the single-token path of dispatch
    assert torch.equal(packed.up_proj, bank.up_proj) and torch.equal(packed.down_proj, bank.down_proj)


def test_many_tokens_run_their_chosen_experts_in_one_call_per_projection(form, monkeypatch):
    """A decode step of 16 sequences chooses most experts with a few rows each: the bank runs all of them in
    one `linear_group` call per projection, and the result is exactly that of one call per expert."""
    torch.manual_seed(2)
    bank = ExpertBank(8, 64, 96).to(torch.bfloat16)
    with torch.no_grad():
        bank.up_proj.normal_(0, 0.2)
        bank.down_proj.normal_(0, 0.2)
    packed = PrepackedExpertBank(bank)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    ids, weights = torch.stack([torch.randperm(8)[:2] for _ in range(16)]), torch.rand(16, 2)
    calls = []
    group = bf16.linear_group
    monkeypatch.setattr(bf16, "linear_group", lambda xs, packs, relu=False: calls.append(len(xs)) or group(xs, packs, relu))
    with torch.inference_mode():
        got = packed(x, weights, ids)
        each = dispatch(x, weights, ids, 8, lambda e, part: bf16.linear(
            bf16.linear(part, packed.up[e], relu=True).square(), packed.down[e]))
    chosen = len(set(ids.flatten().tolist()))
    assert calls == [chosen, chosen] and torch.equal(got, each)


@pytest.mark.parametrize("name", ["all4_ng2_gqa4_c8", "tied_c8"])
def test_prepacked_model_equals_plain(checkpoint, name, form):
    ck = checkpoint(name)
    plain = hybrid.load_model(ck.directory, dtype="bf16", prepack=False)
    packed = hybrid.load_model(ck.directory, dtype="bf16")
    kinds = {type(m).__name__ for m in packed.modules()}
    assert {"PrepackedLinear", "PrepackedExpertBank"} <= kinds and "ExpertBank" not in kinds
    if ck.tf.config.tie_word_embeddings:  # the tied head keeps sharing the embedding matrix: one copy
        assert type(packed.lm_head) is nn.Linear
        assert packed.lm_head.weight.data_ptr() == packed.backbone.embeddings.weight.data_ptr()
    else:
        assert type(packed.lm_head) is PrepackedLinear
    a, b = plain.state_dict(), packed.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert plain.identity == packed.identity
    assert resident_bytes(plain) == resident_bytes(packed)
    ids = torch.randint(3, ck.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref, got = plain(ids), packed(ids)
        cache_ref, cache_got = plain.new_cache(2), packed.new_cache(2)
        plain(ids, cache_ref), packed(ids, cache_got)
        step_ref, step_got = plain(ids[:, -1:], cache_ref), packed(ids[:, -1:], cache_got)
    for r, g in ((ref, got), (step_ref, step_got)):  # both bf16 models; the difference is bf16 noise
        assert float((r - g).abs().max()) <= 0.05 * float(r.abs().max()) + 1e-2


def test_default_checkpoint_greedy_unchanged_by_prepacking(form):
    plain, tok = hybrid.load(DEFAULT_CHECKPOINT, dtype="bf16", prepack=False)
    packed, _ = hybrid.load(DEFAULT_CHECKPOINT, dtype="bf16")
    prompts = [tok.encode("The for statement is used to"), tok.encode("A list is a sequence of")]
    assert [c.token_ids for c in generate_ids(plain, prompts, 24)] == [c.token_ids for c in generate_ids(packed, prompts, 24)]


def test_no_bf16_kernels_leaves_plain_modules(checkpoint, monkeypatch):
    monkeypatch.setattr(onednn, "available", lambda: False)
    monkeypatch.setattr(bf16, "plain_kernel", lambda: None)
    model = hybrid.load_model(checkpoint("all4_ng2_gqa4_c8").directory, dtype="bf16")
    assert not any(isinstance(m, (PrepackedLinear, PrepackedExpertBank)) for m in model.modules())
    with pytest.raises(RuntimeError, match="no bf16 kernels"):
        prepack(model)


def test_fp32_model_is_not_packed(checkpoint):
    assert not any(isinstance(m, PrepackedLinear) for m in checkpoint("all4_ng2_gqa4_c8").ours.modules())


def test_released_pages_read_back_from_the_file(checkpoint):
    """`release` only drops this process's copy of the pages: viewing the tensor again reads the file."""
    files = CheckpointFiles(checkpoint("all4_ng2_gqa4_c8").directory)
    name = max(files.keys(), key=lambda k: files.view(k).numel())
    before = files.view(name).clone()
    files.release(name)
    assert torch.equal(files.view(name), before)


def test_unpack_restores_plain_modules(checkpoint):
    """Quantizing a model loaded for inference unpacks it first (`quantize_model` calls `unpack`)."""
    directory = checkpoint("all4_ng2_gqa4_c8").directory
    plain = hybrid.load_model(directory, dtype="bf16", prepack=False)
    model = hybrid.load_model(directory, dtype="bf16")
    assert unpack(model) > 0
    assert {type(m) for m in model.modules()} == {type(m) for m in plain.modules()}
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [n for n, _ in plain.named_parameters()]
    a, b = plain.state_dict(), model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(plain(ids), model(ids))


def test_packed_model_state_dict_round_trip_and_inference_only_guards(checkpoint, form):
    """`load_state_dict` repacks what it is given (round trip, and a changed tensor takes effect); the
    parameters are frozen, so a backward pass raises instead of leaving packed weights without gradients;
    a dtype or device change raises with a message naming the fix."""
    directory = checkpoint("all4_ng2_gqa4_c8").directory
    model = hybrid.load_model(directory, dtype="bf16")
    plain = hybrid.load_model(directory, dtype="bf16", prepack=False)
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(ids)
    state = model.state_dict()
    assert model.load_state_dict(state, strict=True) is not None
    with torch.inference_mode():
        assert torch.equal(model(ids), before)
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    state["backbone.layers.2.mixer.experts.up_proj"] = state["backbone.layers.2.mixer.experts.up_proj"] * 2
    model.load_state_dict(state)
    plain.load_state_dict(state)
    assert torch.equal(model.backbone.layers[2].mixer.experts.up_proj, plain.backbone.layers[2].mixer.experts.up_proj)
    with torch.inference_mode():
        assert torch.equal(model(ids), torch.zeros_like(before))
    bad = dict(state, **{"lm_head.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="size mismatch for lm_head.weight"):
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})

    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(ids).sum().backward()
    with pytest.raises(RuntimeError, match="stays bf16 on the CPU"):
        model.float()
    assert model.to("cpu") is model


def test_plain_form_weights_stay_views_of_the_checkpoint(checkpoint, tmp_path):
    """Loading a bf16 checkpoint in the plain form copies no prepacked weight: each stays a view of the
    file's memory map (a non-resizable storage, not one of its own), and the model computes the same as
    its copy loaded plainly, after the loader has dropped its handle on the files."""
    if bf16.plain_kernel() is None:
        pytest.skip("the bf16 dot-product kernel is not built for this CPU")
    ck = checkpoint("all4_ng2_gqa4_c8")
    source = hybrid.load_model(ck.directory, dtype="bf16", prepack=False)
    hybrid.save_checkpoint(source, tmp_path / "bf16")  # stored in bf16: the map holds the very bytes
    model = hybrid.load_model(tmp_path / "bf16")
    stored = [m.packed for m in model.modules() if isinstance(m, PrepackedLinear)]
    stored += [w for m in model.modules() if isinstance(m, PrepackedExpertBank) for w in m.up + m.down]
    assert stored and not any(t.untyped_storage().resizable() for t in stored)
    prepack(source)  # the same modules, packed from tensors in memory
    ids = torch.randint(3, ck.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(model(ids), source(ids))


def test_without_mmap_the_weights_are_the_process_own(checkpoint, tmp_path):
    """`mmap=False` (llama.cpp's --no-mmap): every prepacked weight is a copy in the process's memory (a
    storage of its own, as big as the tensor), and the model computes exactly what the mapped one does."""
    if bf16.plain_kernel() is None:
        pytest.skip("the bf16 dot-product kernel is not built for this CPU")
    ck = checkpoint("all4_ng2_gqa4_c8")
    hybrid.save_checkpoint(hybrid.load_model(ck.directory, dtype="bf16", prepack=False), tmp_path / "bf16")
    mapped, copied = hybrid.load_model(tmp_path / "bf16"), hybrid.load_model(tmp_path / "bf16", mmap=False)

    def stored(model):
        return [m.packed for m in model.modules() if isinstance(m, PrepackedLinear)] + [
            w for m in model.modules() if isinstance(m, PrepackedExpertBank) for w in m.up + m.down]

    assert all(not t.untyped_storage().resizable() for t in stored(mapped))
    assert not mapped.backbone.embeddings.weight.untyped_storage().resizable()  # the embeddings are mapped too
    assert copied.backbone.embeddings.weight.untyped_storage().resizable()
    assert stored(copied) and all(t.untyped_storage().resizable()
                                  and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                                  for t in stored(copied))
    ids = torch.randint(3, ck.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(mapped(ids), copied(ids))
