"""`hybrid quantize` and the bytes-by-format report of `hybrid info`, run as subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybrid
from tiny_checkpoint import write_checkpoint

NANO = Path(__file__).resolve().parents[1] / "checkpoints" / "configs" / "nemotron-3-nano-30b-a3b.config.json"
SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
             head_dim=16, mamba_head_dim=16)


def run(*args):
    return subprocess.run([sys.executable, "-m", "hybrid.cli", *args], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli_src"), pattern="ME*E", seed=6, **SIZES)


def test_quantize_then_info_then_generate(src, tmp_path):
    dst = tmp_path / "nvfp4"
    r = run("quantize", str(src), str(dst), "--format", "nvfp4", "--calibration-samples", "2",
            "--calibration-length", "16", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert (dst / "hf_quant_config.json").exists() and (dst / "tokenizer.json").exists()
    model = hybrid.load_model(dst)
    assert model.quantization.method == "modelopt" and model.quantization.labels() == {"NVFP4"}
    scale = model.backbone.layers[1].mixer.experts.up_proj.input_scale
    assert scale.shape == (4,) and bool((scale > 0).all()) and not bool((scale == 1).all())  # calibrated
    info = json.loads(run("info", str(dst), "--json").stdout)
    packed = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                 if t.dtype in (torch.uint8, torch.float8_e4m3fn) or n.endswith(("_scale", "_scale_2")))
    assert info["bytes_by_format"]["NVFP4"] == packed
    assert info["quantization"]["formats"] == ["NVFP4"]
    text = run("info", str(dst)).stdout
    assert "by format      NVFP4:" in text and "modelopt" in text
    r = run("generate", str(dst), "--prompt", "The grass is", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] >= 1


def test_quantize_options_and_errors(src, tmp_path):
    r = run("quantize", str(src), str(tmp_path / "fp8"), "--format", "fp8", "--exclude", "lm_head", "*.experts.*",
            "--calibration-samples", "0")
    assert r.returncode == 0, r.stderr
    hq = json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["exclude_modules"] == ["lm_head", "*.experts.*"]
    model = hybrid.load_model(tmp_path / "fp8")
    assert type(model.backbone.layers[1].mixer.experts).__name__ == "ExpertBank"  # excluded: stays float
    assert type(model.backbone.layers[2].mixer.q_proj).__name__ == "QuantLinear"  # the defaults were replaced
    r = run("quantize", str(tmp_path / "fp8"), str(tmp_path / "again"), "--format", "nvfp4")
    assert r.returncode == 2 and "already quantized" in r.stderr
    r = run("quantize", str(src), str(tmp_path / "x"), "--format", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr


def test_info_plans_nano_nvfp4():
    info = json.loads(run("info", str(NANO), "--format", "nvfp4", "--json").stdout)
    # by hand: NVFP4 bytes of an [o, i] weight are o*i/2 (codes) + o*i/16 (E4M3 scales) + 8 (two fp32 scalars)
    def nvfp4(o, i, n=1):
        return n * (o * i // 2 + o * i // 16 + 8)
    H, E, I, S = 2688, 128, 1856, 3712
    in_proj = (2 * 4096 + 2 * 8 * 128 + 64, H)
    experts = 23 * (nvfp4(I, H, E) + nvfp4(H, I, E))
    shared = 23 * (nvfp4(S, H) + nvfp4(H, S))
    mamba = 17 * (nvfp4(*in_proj) + nvfp4(H, 4096))  # 23 Mamba layers less the 6 feeding attention
    assert info["bytes_by_format"]["NVFP4"] == experts + shared + mamba
    assert info["parameters"] == 31_577_940_288  # logical parameter count unchanged
