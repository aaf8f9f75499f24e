"""scripts/bench.py --smoke: the benchmark runs end to end against transformers and reports consistent figures
(no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from hybrid.accounting import describe
from hybrid.config import HybridConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--peers", "transformers", "--workdir",
                           str(tmp_path / "work"), "--out", str(out), "--threads", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    ours, tf = report["engines"]["ours"], report["engines"]["transformers"]
    assert "error" not in tf, tf
    assert report["lengths"] == [64] and report["batches"] == [1, 2]
    for engine in (ours, tf):
        assert engine["prefill"]["64"]["tok_s"] > 0 and engine["decode"]["2"]["tok_s"] > 0
        assert engine["peak_rss_bytes"] > report["checkpoint_bytes"]

    config = HybridConfig.from_file(tmp_path / "work" / "tiny" / "config.json")
    facts = describe(config, torch.bfloat16)
    assert ours["prefill"]["64"]["cache_bytes"] == 64 * facts["kv_cache_bytes_per_token"] + facts["mamba_state_bytes_per_sequence"]
    assert report["active_weight_bytes"] == 2 * facts["active_parameters_per_token"]
    assert abs(report["decode_limit_tok_s"] - report["bandwidth_gb_s"] * 1e9 / report["active_weight_bytes"]) < 1e-6 * report["decode_limit_tok_s"]
    ratio = next(t for t in report["targets"] if t["target"] == "decode vs transformers")
    assert abs(ratio["value"] - ours["decode"]["1"]["tok_s"] / tf["decode"]["1"]["tok_s"]) < 1e-3 * ratio["value"] + 1e-3
    assert "decode b1 roofline ratio" in done.stdout and "transformers" in done.stdout
    memory = next(t for t in report["targets"] if t["target"] == "(ckpt + 2 GB) / peak RSS")
    assert abs(memory["value"] - (report["checkpoint_bytes"] + 2e9) / ours["peak_rss_bytes"]) <= 1e-3
