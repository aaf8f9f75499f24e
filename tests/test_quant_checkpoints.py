"""Real quantized checkpoints: ModelOpt exports of a tiny transformers NemotronH (FP8, NVFP4), checkpoints
made with compressed-tensors' own compressors and config, and ours from `hybrid.quantize`.

Oracles: each producer's own dequantization of its tensors (ModelOpt `FP8QTensor` / `NVFP4QTensor`,
compressed-tensors' compressors), and the bf16 transformers model the checkpoint was made from.
"""

import copy
import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import helpers
import hybrid
from hybrid.quantize import default_exclusions, quantize_model
from hybrid.saving import published_state_dict, save_checkpoint
from moe.quant import PackedWeight, kernels
from tiny_checkpoint import write_checkpoint

mtq = pytest.importorskip("modelopt.torch.quantization")
qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.mx_utils import decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_quant_oracles import ct_compress  # noqa: E402

TF_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=64, head_dim=16, mamba_head_dim=16, n_groups=2)
# logit agreement of the ModelOpt exports with the bf16 model they were made from (24 positions, vocab 96,
# logit std ~0.4): bounds a little above what was measured (FP8 KL 4e-4, max |d| 0.12; NVFP4 KL 5e-3, 0.47)
BOUNDS = {"fp8": dict(kl=2e-3, max_abs=0.25), "nvfp4": dict(kl=2e-2, max_abs=0.8)}


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p, q = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def modelopt_exports(tmp_path_factory):
    """{fmt: (export dir, bf16 reference logits, test ids)}: a tiny NemotronH quantized by ModelOpt on the CPU."""
    from transformers import NemotronHForCausalLM

    out = {}
    test_ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    for fmt, cfg in (("fp8", mtq.FP8_DEFAULT_CFG), ("nvfp4", mtq.NVFP4_DEFAULT_CFG)):
        torch.manual_seed(0)
        config = helpers.tf_config("M*ME-", **TF_SIZES)
        config.architectures = ["NemotronHForCausalLM"]  # ModelOpt's export reads it
        model = NemotronHForCausalLM(config).eval()
        helpers.randomise_(model, 1, linear_std=0.05)
        model = model.to(torch.bfloat16)
        with torch.no_grad():
            ref = model(input_ids=test_ids, use_cache=False).logits.float()
        calib = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
        mtq.quantize(model, copy.deepcopy(cfg), lambda m: m(calib))
        directory = tmp_path_factory.mktemp(f"modelopt_{fmt}")
        # dtype must be given: ModelOpt 0.47 reads config.torch_dtype, a string under transformers 5
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=directory)
        out[fmt] = (directory, ref, test_ids)
    return out


def _file_tensors(directory):
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _modelopt_dequant(tensors: dict, module: str) -> torch.Tensor:
    w = tensors[f"{module}.weight"]
    if w.dtype == torch.float8_e4m3fn:
        return qtensor.FP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32, scale=tensors[f"{module}.weight_scale"])
    shape = (w.shape[0], w.shape[1] * 2)
    return qtensor.NVFP4QTensor(shape, torch.float32, w).dequantize(
        dtype=torch.float32, scale=tensors[f"{module}.weight_scale"], double_scale=tensors[f"{module}.weight_scale_2"],
        block_sizes={-1: 16})


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_modelopt_export_dequantizes_exactly_like_modelopt(modelopt_exports, fmt):
    directory, _, _ = modelopt_exports[fmt]
    tensors = _file_tensors(directory)
    model = hybrid.load_model(directory, dtype="fp32")
    modules = dict(model.named_modules())
    quantized = sorted(k[: -len(".weight")] for k, v in tensors.items()
                       if k.endswith(".weight") and v.dtype in (torch.uint8, torch.float8_e4m3fn))
    assert len(quantized) >= 20  # mamba in/out, attention, shared expert, 4 experts x 2, dense MLP
    scales = set()
    for name in quantized:
        theirs = _modelopt_dequant(tensors, name)
        if ".experts." in name:  # backbone.layers.3.mixer.experts.{j}.{proj}
            prefix, j, proj = name.rsplit(".", 2)
            ours = modules[f"{prefix}.{proj}"].dequantize(torch.float32, expert=int(j))
            scales.add(float(tensors[f"{name}.weight_scale" if fmt == "fp8" else f"{name}.weight_scale_2"]))
            assert modules[f"{prefix}.{proj}"].activation_scale(int(j)) == tensors[f"{name}.input_scale"]
        else:
            assert isinstance(modules[name], PackedWeight), name
            ours = modules[name].dequantize(torch.float32)
            assert modules[name].input_scale == tensors[f"{name}.input_scale"]
        assert torch.equal(ours, theirs), name
    # docs/cases.md 12: every expert keeps its own scale (nothing fused under one scale)
    assert len(scales) == 8


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_modelopt_export_logits_close_to_bf16(modelopt_exports, fmt):
    directory, ref, ids = modelopt_exports[fmt]
    logits = hybrid.load_model(directory, dtype="bf16")(ids)
    kl, max_abs = _kl(ref, logits), (logits - ref).abs().max().item()
    helpers.REPORT[f"ModelOpt {fmt} export vs bf16: KL, max |logit diff|, top-1"] = (
        f"{kl:.2e}, {max_abs:.3f}, {(logits.argmax(-1) == ref.argmax(-1)).float().mean().item():.2f}")
    assert kl < BOUNDS[fmt]["kl"] and max_abs < BOUNDS[fmt]["max_abs"], (kl, max_abs)


def test_our_quantize_writes_the_modelopt_config_layout(modelopt_exports, tmp_path):
    src = write_checkpoint(tmp_path / "src", pattern="M*ME-", **{k: v for k, v in TF_SIZES.items()})
    model = quantize_model(hybrid.load_model(src, dtype="bf16"), "nvfp4", exclude=["lm_head"])
    save_checkpoint(model, tmp_path / "q")
    ours_hf = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())
    ours_block = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    theirs_dir = modelopt_exports["nvfp4"][0]
    theirs_hf = json.loads((theirs_dir / "hf_quant_config.json").read_text())
    theirs_block = json.loads((theirs_dir / "config.json").read_text())["quantization_config"]
    assert ours_hf["quantization"].keys() == theirs_hf["quantization"].keys()
    assert {k: v for k, v in ours_hf["quantization"].items() if k != "exclude_modules"} == \
        {k: v for k, v in theirs_hf["quantization"].items() if k != "exclude_modules"}
    assert ours_block.keys() == theirs_block.keys() and ours_block["config_groups"] == theirs_block["config_groups"]
    assert ours_block["quant_method"] == "modelopt" and ours_block["quant_algo"] == "NVFP4"
    # the same tensor names, dtypes and shapes as ModelOpt writes for the same architecture
    ours_t, theirs_t = _file_tensors(tmp_path / "q"), _file_tensors(theirs_dir)
    for name, t in theirs_t.items():
        if t.dtype in (torch.uint8, torch.float8_e4m3fn) or name.endswith(("_scale", "_scale_2")):
            assert name in ours_t and ours_t[name].dtype == t.dtype and ours_t[name].shape == t.shape, name


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_quantize_round_trip_and_modelopt_reads_ours(tmp_path, fmt):
    src = write_checkpoint(tmp_path / "src", pattern="ME*E", seed=2, **{k: v for k, v in TF_SIZES.items() if k != "n_groups"})
    ids = torch.randint(5, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    model = quantize_model(hybrid.load_model(src, dtype="bf16"), fmt, calibration=[ids])
    save_checkpoint(model, tmp_path / "q", max_shard_bytes=30_000)
    # prepack=False: the quantized model in memory keeps its bf16 modules plain, so the reloaded one must too for
    # the logits to be bit-equal (a prepacked head sums in another order)
    back = hybrid.load_model(tmp_path / "q", dtype="bf16", prepack=False)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    assert torch.equal(model(ids), back(ids))
    # the default exclusions: attention (layer 2) and the Mamba layer feeding it (layer 0) stay bf16
    assert model.quantization.exclude == default_exclusions(model.config)
    sd = published_state_dict(back)
    assert sd["backbone.layers.2.mixer.q_proj.weight"].dtype == torch.bfloat16
    assert sd["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    expert = "backbone.layers.1.mixer.experts.3.up_proj"
    if fmt == "mxfp4":  # compressed-tensors' MXFP4 decompressor reads our bytes (its names: weight_packed)
        scheme = ct_quant.preset_name_to_scheme("MXFP4", ["Linear"])
        dense = BaseCompressor.load_from_registry("mxfp4-pack-quantized").decompress(
            {"weight_packed": sd[f"{expert}.weight"], "weight_scale": sd[f"{expert}.weight_scale"]}, scheme)["weight"]
        ours = back.backbone.layers[1].mixer.experts.up_proj.dequantize(torch.float32, expert=3)
        assert torch.equal(ours.to(dense.dtype), dense)
    else:  # ModelOpt's own dequantization of the tensors we wrote
        ours = back.backbone.layers[1].mixer.experts.up_proj.dequantize(torch.float32, expert=3)
        assert torch.equal(_modelopt_dequant(sd, expert), ours)
        assert sd[f"{expert}.input_scale"] > 0


@pytest.mark.parametrize("preset", ["FP8", "NVFP4", "MXFP4"])
def test_compressed_tensors_checkpoint(tmp_path, preset):
    """A checkpoint made with compressed-tensors' compressors and its QuantizationConfig (as llm-compressor
    writes them; llm-compressor itself pins transformers <= 5.17 and cannot be installed next to 5.24)."""
    src = write_checkpoint(tmp_path / "src", pattern="ME*-", seed=4, **{k: v for k, v in TF_SIZES.items() if k != "n_groups"})
    dense = hybrid.load_model(src, dtype="fp32")
    tensors = _file_tensors(src)
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    linears = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    linears += [f"backbone.layers.1.mixer.experts.{j}.{p}" for j in range(4) for p in ("up_proj", "down_proj")]
    fmt_name = {"FP8": "float-quantized", "NVFP4": "nvfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized"}[preset]
    compressor = BaseCompressor.load_from_registry(fmt_name)
    expected = {}
    for name in linears:
        w = tensors.pop(f"{name}.weight")
        out, _ = ct_compress(preset, w)
        out.pop("weight_zero_point", None)
        if preset == "FP8":
            out["input_scale"] = torch.tensor([0.02])
        if preset == "NVFP4":
            out["input_global_scale"] = torch.tensor([448.0 * 6 / 3.0])
        decompressed = compressor.decompress(dict(out), scheme)["weight"]  # bf16 for FP4, fp32 for FP8
        if preset == "FP8":
            fp32 = decompressed
        else:  # its dequantize in fp32 on its own unpacked codes and scales
            codes = unpack_fp4_from_uint8(out["weight_packed"], w.shape[0], w.shape[1], dtype=torch.float32)
            scale = out["weight_scale"].float() if preset == "NVFP4" else decompress_mx_scale(out["weight_scale"]).float()
            fp32 = ct_dequantize(codes, scale, args=scheme.weights, global_scale=out.get("weight_global_scale"),
                                 dtype=torch.float32)
        expected[name] = (decompressed, fp32)
        tensors.update({f"{name}.{k}": v for k, v in out.items()})
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    block = ct_quant.QuantizationConfig(config_groups={"group_0": scheme}, format=fmt_name, ignore=["lm_head"]).model_dump()
    block["quant_method"] = "compressed-tensors"
    raw = json.loads((tmp_path / "src" / "config.json").read_text())
    raw["quantization_config"] = json.loads(json.dumps(block, default=str))
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))

    model = hybrid.load_model(tmp_path / "src", dtype="fp32")
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (decompressed, fp32) in expected.items():
            if ".experts." in name:
                prefix, j, proj = name.rsplit(".", 2)
                ours = modules[f"{prefix}.{proj}"].dequantize(torch.float32, expert=int(j))
                getattr(dense.get_submodule(prefix), proj)[int(j)] = fp32
            else:
                ours = modules[name].dequantize(torch.float32)
                dense.get_submodule(name).weight.copy_(fp32)
            assert torch.equal(ours, fp32), name
            assert torch.equal(ours.to(decompressed.dtype), decompressed), name
    # the packed model computes what the dense model with compressed-tensors' dequantized weights computes
    ids = torch.randint(5, 96, (2, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dense(ids)
        with pytest.MonkeyPatch.context() as mp:  # the PyTorch path: the same operations as the dense model's
            mp.setattr(kernels, "cpu_for", lambda x, fmt: None)
            torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
        got = model(ids)  # from the packed bytes (moe.quant.kernels.cpu): fp32 sums in another order
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
