"""scripts/train.py: a few steps of the smoke preset write a checkpoint in the published layout that
transformers' NemotronHForCausalLM reads with the same logits as ours."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hybrid

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--preset", "smoke",
                        "--steps", "4", "--seq-len", "64", "--batch-size", "2", "--eval-every", "2",
                        "--eval-samples", "2", "--save-dtype", "float32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_published_layout(trained):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    config = json.loads((trained / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "ME*E" and config["mtp_hybrid_override_pattern"] == "*E"
    assert "layers_block_type" not in config and config["num_nextn_predict_layers"] == 1
    with safe_open(trained / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("backbone.layers.1.mixer.gate.e_score_correction_bias").get_dtype() == "F32"
    assert "backbone.layers.1.mixer.experts.3.up_proj.weight" in keys
    assert "mtp.layers.0.eh_proj.weight" in keys and "mtp.layers.1.mixer.experts.0.down_proj.weight" in keys
    assert not any(".experts.up_proj" in k for k in keys)


def test_transformers_reads_it_with_our_logits(trained):
    from transformers import NemotronHForCausalLM

    ours, tok = hybrid.load(trained, dtype="fp32")
    # transformers' prefill clamps dt at time_step_min (an initialisation setting; the trap of
    # test_cases.py case 1); trained dt can go below it, so the oracle is run without that clamp
    theirs = NemotronHForCausalLM.from_pretrained(trained, dtype=torch.float32, time_step_min=0.0).eval()
    ids = torch.tensor([tok.encode("The pass key is 12345. Remember it. What is the pass key? The pass key is")])
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids), atol=1e-4, rtol=0)


def test_training_log(trained):
    log = json.loads((trained / "training_log.json").read_text())
    assert log["summary"]["steps"] == 4 and len(log["history"]) == 4
    assert all(r["loss"] > 0 and r["max_over_mean_load"] >= 1 for r in log["history"])
    assert "val_loss" in log["history"][1]


def test_a_failed_save_leaves_no_half_written_output(tmp_path, monkeypatch):
    """The checkpoint, tokenizer files and training log are one write: if the last of them fails, --out is left
    as it was (absent here), not a checkpoint without its log or tokenizer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == "training_log.json":
            raise OSError(28, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        train.main(["--out", str(out), "--preset", "smoke", "--steps", "1", "--seq-len", "64", "--batch-size", "2",
                    "--eval-every", "100", "--eval-samples", "1", "--save-dtype", "float32"])
    assert not out.exists() and list(tmp_path.iterdir()) == []
