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
    scale = model.backbone.layers[1].mixer.experts.up_proj.activation_scale()
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


def test_quantizing_every_linear_keeps_a_tied_head_unquantized(tmp_path):
    """`--exclude` alone on a tied model: the head stays the embedding matrix (noted and recorded), and the
    result loads and computes what quantizing with lm_head excluded computes."""
    from hybrid.quantize import quantize_model

    src = write_checkpoint(tmp_path / "tied", "M*E-", seed=1, tie_word_embeddings=True)
    r = run("quantize", str(src), str(tmp_path / "fp8"), "--format", "fp8", "--exclude", "--calibration-samples", "0")
    assert r.returncode == 0, r.stderr
    assert "note:" in r.stderr and "lm_head" in r.stderr and "tied" in r.stderr
    hq = json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["exclude_modules"] == ["lm_head"]
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    assert "`lm_head`" in (tmp_path / "fp8" / "README.md").read_text()
    model, _ = hybrid.load(tmp_path / "fp8", progress=False)
    assert type(model.lm_head).__name__ != "QuantLinear"
    assert type(model.backbone.layers[1].mixer.q_proj).__name__ == "QuantLinear"  # every other Linear quantized
    expected = quantize_model(hybrid.load_model(src, prepack=False), "fp8", exclude=["lm_head"])
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    with torch.no_grad():
        assert torch.equal(model(ids), expected(ids))
    in_memory = quantize_model(hybrid.load_model(src, prepack=False), "fp8", exclude=[])  # the same in memory
    assert in_memory.quantization.exclude == ["lm_head"]
    with torch.no_grad():
        assert torch.equal(in_memory(ids), expected(ids))


@pytest.mark.parametrize("where", ["under-a-file", "proc", "unwritable"])
def test_an_output_that_cannot_be_created_is_refused_before_any_work(src, tmp_path, monkeypatch, capsys, where):
    import os

    from hybrid import calibration, quantize
    from hybrid.checkpoint_writer import WriteError
    from hybrid.cli import main

    if where == "unwritable" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    (tmp_path / "file").write_text("x")
    (tmp_path / "ro").mkdir(mode=0o555)
    dst = {"under-a-file": tmp_path / "file" / "out", "proc": Path("/proc/nope/x"),
           "unwritable": tmp_path / "ro" / "out"}[where]

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the destination was checked")

    monkeypatch.setattr(calibration, "calibration_batches", no_work)  # the CLI's first work: calibration text
    monkeypatch.setattr(quantize, "calibrate_streamed", no_work)
    monkeypatch.setattr(quantize, "CheckpointFiles", no_work)
    assert main(["quantize", str(src), str(dst), "--format", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(dst) in err and "Traceback" not in err, err
    with pytest.raises(WriteError, match="cannot be created"):
        quantize.quantize_checkpoint(src, dst, "fp8", calibration=[torch.tensor([[5, 6, 7]])])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_info_names_the_formats_of_a_quantized_checkpoint(src, tmp_path):
    r = run("quantize", str(src), str(tmp_path / "fp8"), "--format", "fp8", "--calibration-samples", "0")
    assert r.returncode == 0, r.stderr
    info = json.loads(run("info", str(tmp_path / "fp8"), "--json").stdout)
    assert info["dtype"] == "float32" and info["storage"] == "FP8 + float32 rest"
    text = run("info", str(tmp_path / "fp8")).stdout
    assert "GiB, FP8 + float32 rest)" in text and "GiB, float32)" not in text
    assert "GiB, float32)" in run("info", str(src)).stdout  # an unquantized checkpoint: its dtype
    assert json.loads(run("info", str(src), "--format", "nvfp4", "--dtype", "bf16", "--json").stdout)["storage"] == \
        "NVFP4 + bfloat16 rest"


def test_a_full_disk_during_quantize_is_one_error_line_and_leaves_the_destination(src, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own SafetensorError: the CLI says so in one line (exit 1),
    the existing destination is as it was and no temporary directory is left."""
    from safetensors import SafetensorError

    import hybrid.checkpoint_writer
    from hybrid.cli import main

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")

    def full(tensors, filename, metadata=None):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(hybrid.checkpoint_writer, "save_file", full)
    assert main(["quantize", str(src), str(dst), "--format", "fp8", "--overwrite", "--calibration-samples", "0"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error")]  # past the bar
    assert len(errors) == 1 and errors[0].startswith(f"error: writing {dst} failed"), err
    assert "No space left on device" in errors[0] and "left as it was" in errors[0] and "Traceback" not in err
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"] and (dst / "keep.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("kind,expected", [
    ("missing", "no such file"), ("directory", "is a directory"), ("not-utf8", "not UTF-8 text (byte 0xff"),
    ("empty", "the file is empty"), ("blank", "the file is empty")])
def test_a_bad_calibration_file_is_refused_before_any_work(src, tmp_path, monkeypatch, capsys, kind, expected):
    """One `error:` line naming --calibration-file and the file, exit 2, nothing created, no work started."""
    from hybrid import calibration, quantize
    from hybrid.cli import main

    path = tmp_path / "calib.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-utf8":
        path.write_bytes(b"good text \xff\xfe")
    elif kind in ("empty", "blank"):
        path.write_text("" if kind == "empty" else " \n\t\n")

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the calibration file was checked")

    monkeypatch.setattr(calibration, "calibration_batches", no_work)
    monkeypatch.setattr(quantize, "quantize_checkpoint", no_work)
    dst = tmp_path / "new" / "out"
    assert main(["quantize", str(src), str(dst), "--format", "fp8", "--calibration-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --calibration-file {path}: {err.split(': ', 2)[2]}" and expected in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_negative_calibration_samples_are_refused(src, tmp_path, capsys):
    from hybrid.cli import main

    with pytest.raises(SystemExit) as e:
        main(["quantize", str(src), str(tmp_path / "out"), "--format", "fp8", "--calibration-samples", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--calibration-samples: must be a non-negative integer, got -1" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_mxfp4_says_it_takes_no_calibration(src, tmp_path, capsys):
    """MXFP4 has no static input scales: the summary says no calibration ran (not "0 calibration samples"
    after the user asked for some) and a --calibration-file is named as unused; NVFP4 counts its samples."""
    from hybrid.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("Some text to calibrate on. " * 40)
    assert main(["quantize", str(src), str(tmp_path / "mx"), "--format", "mxfp4", "--calibration-samples", "4",
                 "--calibration-file", str(text)]) == 0
    err = capsys.readouterr().err
    assert "note: --calibration-file is not used: mxfp4 has no static input scales" in err
    assert "no calibration: mxfp4 has no static input scales" in err and "calibration samples" not in err
    assert main(["quantize", str(src), str(tmp_path / "nv"), "--format", "nvfp4", "--calibration-samples", "2",
                 "--calibration-length", "16", "--calibration-file", str(text)]) == 0
    err = capsys.readouterr().err
    assert "2 calibration samples" in err and "not used" not in err
