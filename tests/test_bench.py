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


def test_bench_parallel_smoke(tmp_path):
    """scripts/bench_parallel.py on the tiny preset: N = 1 and 2 run; each rank of 2 holds and reads what
    `hybrid info --tensor-parallel 2` states for it, and sends per token the ring bytes of the plan's traffic."""
    from hybrid.accounting import describe_ranks
    from hybrid.parallel import ring_bytes

    out = tmp_path / "parallel.json"
    done = subprocess.run([sys.executable, str(SCRIPT.with_name("bench_parallel.py")), "--preset", "tiny",
                           "--decode-tokens", "4", "--repeats", "1", "--allreduce-calls", "20", "--workdir",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    config = HybridConfig.from_file(tmp_path / "work" / "tiny" / "config.json")
    stated = describe_ranks(config, torch.bfloat16, 2)
    assert report["one"]["weight_bytes"] == describe(config, torch.bfloat16)["weight_bytes"]
    for rank in report["two"]:
        assert rank["weight_bytes"] == rank["read_bytes"] == stated["ranks"][rank["rank"]]["weight_bytes"]
        payload = rank["traffic"]["payload"]
        assert rank["traffic"]["sent_bytes"] == ring_bytes(payload["all_reduce"], payload["all_gather"], 2) \
            == stated["ring_bytes_sent_per_token"]
        assert rank["allreduce_s"] > 0
    assert "traffic per token = ShardPlan.traffic: pass" in done.stdout
