"""The nano-slice bench's llama.cpp runs (`scripts/bench_formats.py`): a peer that dies of a signal with its
extra buffer types (llama.cpp's AMX repacking segfaulted on a 2-core Xeon with AMX) is run again without
them and marked so; a peer failing otherwise is reported as an error, not retried."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

# stands in for the peer's python: argv = -c WORKER t0 gguf prefill decode threads extra; records each call
FAKE_PEER = """#!/usr/bin/env bash
echo "$8" >> "$(dirname "$0")/calls"
case "$MODE:$8" in
  crash-with-extra:1) kill -SEGV $$ ;;
  fail:*) echo "bad model file" >&2; exit 3 ;;
esac
echo '{"load_s": 0.5, "first_token_s": 1.0, "prefill_tok_s": 100.0, "decode_tok_s": 20.0, "peak_rss_bytes": 1}'
"""


def load_bench_formats():
    spec = importlib.util.spec_from_file_location("script_bench_formats", ROOT / "scripts" / "bench_formats.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def peer(tmp_path):
    python = tmp_path / "python"
    python.write_text(FAKE_PEER)
    python.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    args = SimpleNamespace(llama_python=python, prefill=8, decode_tokens=4, threads=2)
    return load_bench_formats(), args, gguf, tmp_path / "calls"


@pytest.mark.parametrize("mode, calls, extra", [("ok", ["1"], 1), ("crash-with-extra", ["1", "0"], 0)])
def test_llama_run_retries_without_extra_buffers_after_a_signal(peer, monkeypatch, mode, calls, extra):
    bench, args, gguf, log = peer
    monkeypatch.setenv("MODE", mode)
    result = bench.run_llama(args, gguf)
    assert log.read_text().split() == calls
    assert result["decode_tok_s"] == 20.0 and result["extra_buffers"] == extra


def test_llama_run_reports_other_failures_once(peer, monkeypatch):
    bench, args, gguf, log = peer
    monkeypatch.setenv("MODE", "fail")
    result = bench.run_llama(args, gguf)
    assert log.read_text().split() == ["1"]
    assert result == {"error": "bad model file"}


def test_report_marks_runs_without_extra_buffers(peer, capsys):
    bench = peer[0]
    run = {"load_s": 0.5, "first_token_s": 1.0, "prefill_tok_s": 100.0, "decode_tok_s": 20.0, "peak_rss_bytes": 1e9}
    report = {"bandwidth_gb_s": 30.0, "bandwidth_probe_gb_s": 30.0, "llama_bf16_streams_gb_s": 20.0,
              "results": {"llama.cpp bf16": {**run, "extra_buffers": 1}, "llama.cpp Q8_0": {**run, "extra_buffers": 0}},
              "ours_bytes_per_token": {}, "llama_bytes": {}, "projection_nano_decode_tok_s": {}, "quantize": {},
              "targets": []}
    bench.print_report(json.loads(json.dumps(report)))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("llama.cpp Q8_0 *") for line in lines)
    assert any(line.startswith("llama.cpp bf16 ") and "*" not in line for line in lines)
    assert lines[-1].startswith("* llama.cpp without its extra buffer types")
