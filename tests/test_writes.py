"""Nothing the project writes is ever lost, partial or stale (issue 15).

- Every single-file write goes through `hybrid.atomic` and every checkpoint directory through
  `hybrid.checkpoint_writer` (the source audit below); append-only `records.jsonl` is the one exception.
- A failure in the middle of a write leaves the previous file (checked for the eval tables and plots, the
  recall study's outputs, bench JSON) and no temporary file.
- A checkpoint written over an older one reloads what was just written, sharded over single and back.
- Files get the user's umask (0o027 -> 0o640 files, 0o750 directories).
- A quantized checkpoint keeps the source's other files byte for byte, its generation defaults, and records
  what changed in its model card.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import hybrid
from hybrid.eval import plots, results
from hybrid.quantize import quantize_checkpoint, quantize_model
from tiny_checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [{"model": m, "task": t, "context_length": n, "depth_percent": d, "score": s}
           for m, t, n, d, s in [("a", "passkey", 400, 0.0, 1.0), ("a", "passkey", 400, 100.0, 0.0),
                                 ("a", "passkey", 600, 0.0, 1.0), ("b", "passkey", 400, 0.0, 0.5),
                                 ("b", "passkey", 600, 100.0, 1.0)]]


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def half_write_text(monkeypatch, keep: int | None = None):
    """From now on Path.write_text writes part of its text (`keep` characters, or half) to the file it
    opens, then fails as a full disk does."""
    real = Path.write_text

    def text(self, data, *args, **kwargs):
        real(self, data[:len(data) // 2 if keep is None else keep], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", text)


# ---------------------------------------------------------------------------------------------- the audit
WRITE_CALL = re.compile(r"""\.write_text\(|\.write_bytes\(|\bsave_file\(|\.savefig\(|\bjson\.dump\(|\.to_csv\(|"""
                        r"""\btorch\.save\(|\btok\.save\(|open\([^)]*["'](w|wb|x|a\+?|r\+)["']""")
EXEMPT = {"hybrid/atomic.py"}  # the atomic writer itself


def test_every_write_goes_through_atomic_or_the_checkpoint_writer():
    """A write call is allowed only on a temporary path (`tmp`, from `atomic_path` or the checkpoint
    writer's temporary directory), through a `CheckpointWriter`, as an append (`records.jsonl`, a log), or to a
    kernel control file under /proc (no file is written: bench_serve resets a process's peak RSS)."""
    offenders = []
    for path in sorted([*(ROOT / "hybrid").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXEMPT:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r"\b(writer|self)\.write_(text|json)\(", "", line.split("#")[0])  # CheckpointWriter's
            if WRITE_CALL.search(code) and "tmp" not in code and 'open("a")' not in code and '"/proc/' not in code \
                    and "f\"/proc/" not in code:
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


# ---------------------------------------------------------------------------------------------- failures mid-write
def test_eval_tables_survive_a_failed_rewrite(tmp_path, monkeypatch):
    results.write_summary(RECORDS, tmp_path)
    results.write_task_pivots(RECORDS, tmp_path)
    before = listing(tmp_path)
    real_writer = csv.writer

    class FailingWriter:  # the second row fails, after the header was written
        def __init__(self, f, *args, **kwargs):
            self.writer, self.rows = real_writer(f, *args, **kwargs), 0

        def writerow(self, row):
            self.rows += 1
            if self.rows == 2:
                raise OSError(28, "No space left on device")
            return self.writer.writerow(row)

    monkeypatch.setattr(csv, "writer", FailingWriter)
    changed = [dict(r, score=1 - r["score"]) for r in RECORDS]
    with pytest.raises(OSError):
        results.write_summary(changed, tmp_path)
    with pytest.raises(OSError):
        results.write_task_pivots(changed, tmp_path)
    assert listing(tmp_path) == before
    monkeypatch.setattr(csv, "writer", real_writer)
    half_write_text(monkeypatch, keep=10)
    with pytest.raises(OSError):
        results.write_summary(changed, tmp_path)
    assert listing(tmp_path) == before  # summary.md not cut to 10 characters, no temporary file left


def test_plots_survive_a_failed_rewrite(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    first = [plots.write_length_plot(RECORDS, tmp_path), *plots.write_heatmaps(RECORDS, tmp_path)]
    assert [p.name for p in first] == ["accuracy_vs_length.png", "heatmap_passkey.png"]
    before = listing(tmp_path)

    def partial_savefig(self, fname, *args, **kwargs):
        Path(fname).write_bytes(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", partial_savefig)
    with pytest.raises(OSError):
        plots.write_length_plot(RECORDS, tmp_path)
    with pytest.raises(OSError):
        plots.write_heatmaps(RECORDS, tmp_path)
    assert listing(tmp_path) == before


def test_recall_study_outputs_survive_a_failed_rewrite(tmp_path, monkeypatch):
    rs = load_script("recall_study")
    record = {k: 1 for k in rs.FIELDS}
    rs.write_jsonl([record], tmp_path / "results.jsonl")
    rs.write_csv([record], tmp_path / "results.csv")
    before = listing(tmp_path)
    half_write_text(monkeypatch)
    with pytest.raises(OSError):
        rs.write_jsonl([record, record], tmp_path / "results.jsonl")
    with pytest.raises(OSError):
        rs.write_csv([record, record], tmp_path / "results.csv")
    assert listing(tmp_path) == before


def test_bench_json_survives_a_failed_rewrite(tmp_path, monkeypatch):
    """The bench scripts write their JSON with `write_json`; a failure keeps the previous report."""
    out = tmp_path / "bench.json"
    for name in ("bench", "bench_formats", "bench_prefix_cache", "bench_speculative", "quantize_report"):
        script = load_script(name)
        script.write_json(out, {"run": 1})
        before = out.read_bytes()
        half_write_text(monkeypatch, keep=3)
        with pytest.raises(OSError):
            script.write_json(out, {"run": 2, "more": list(range(100))})
        monkeypatch.undo()
        assert out.read_bytes() == before and json.loads(before) == {"run": 1}, name
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"], name


# ---------------------------------------------------------------------------------------------- stale files
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = write_checkpoint(tmp_path_factory.mktemp("writes_src"), "ME*E", seed=4)
    (src / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": 0, "do_sample": True, "temperature": 0.6,
         "top_p": 0.95, "top_k": 20}, indent=1))
    (src / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}")
    (src / "README.md").write_text("# Tiny model\n\nA model card.\n")
    return src


def logits(directory) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    with torch.no_grad():
        return hybrid.load_model(directory)(ids)


@pytest.mark.parametrize("first,second", [(2_000, None), (None, 2_000)])
def test_a_checkpoint_written_over_another_reloads_what_was_just_written(source, tmp_path, first, second):
    a = hybrid.load_model(source)
    b = write_checkpoint(tmp_path / "other", "ME*E", seed=5)
    dst = hybrid.save_checkpoint(a, tmp_path / "dst", max_shard_bytes=first)
    hybrid.save_checkpoint(hybrid.load_model(b), dst, max_shard_bytes=second, overwrite=True)
    assert torch.equal(logits(dst), logits(b))
    names = {p.name for p in dst.iterdir()}
    assert ("model.safetensors" in names) == (second is None)
    assert ("model.safetensors.index.json" in names) == (second is not None)
    assert not any(n.startswith("model-") for n in names) if second is None else "model.safetensors" not in names
    # the same through the streamed quantizer: fp8 shards over a single file and back
    quantize_checkpoint(source, dst, "fp8", max_shard_bytes=first, overwrite=True)
    quantize_checkpoint(b, dst, "fp8", max_shard_bytes=second, overwrite=True)
    memory = tmp_path / "memory"
    hybrid.save_checkpoint(quantize_model(hybrid.load_model(b, prepack=False), "fp8"), memory)
    assert torch.equal(logits(dst), logits(memory))
    assert ("model.safetensors" in {p.name for p in dst.iterdir()}) == (second is None)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- umask
def test_written_files_follow_a_non_default_umask(source, tmp_path):
    old = os.umask(0o027)
    try:
        from hybrid.cli import main

        assert main(["quantize", str(source), str(tmp_path / "q"), "--format", "fp8", "--calibration-samples", "0",
                     "--max-shard-bytes", "20000"]) == 0
        hybrid.save_checkpoint(hybrid.load_model(source), tmp_path / "saved", source=source)
        results.write_summary(RECORDS, tmp_path / "eval")
        results.write_task_pivots(RECORDS, tmp_path / "eval")
        if importlib.util.find_spec("matplotlib"):
            plots.write_length_plot(RECORDS, tmp_path / "eval")
        load_script("bench").write_json(tmp_path / "bench.json", {"x": 1})
        rs = load_script("recall_study")
        rs.write_jsonl([{k: 1 for k in rs.FIELDS}], tmp_path / "eval" / "results.jsonl")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 15
    assert {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files} == {
        p.relative_to(tmp_path).as_posix(): oct(0o640) for p in files}
    for d in ("q", "saved", "eval"):
        assert (tmp_path / d).stat().st_mode & 0o777 == 0o750, d


# ---------------------------------------------------------------------------------------------- derived checkpoints
def test_a_quantized_checkpoint_keeps_the_source_files_and_records_the_change(source, tmp_path):
    from hybrid.cli import main

    dst = tmp_path / "fp8"
    assert main(["quantize", str(source), str(dst), "--format", "fp8", "--calibration-samples", "0"]) == 0
    kept = ["chat_template.jinja", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
            "tokenizer_config.json"]
    for name in kept:
        assert (dst / name).read_bytes() == (source / name).read_bytes(), name
    card = (dst / "README.md").read_text()
    original = (source / "README.md").read_text()
    assert card.startswith(original) and len(card) > len(original)
    section = card[len(original):]
    assert "FP8" in section and "hybrid quantize" in section and str(source) in section
    hq = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert hq["exclude_modules"] and all(f"`{p}`" in section for p in hq["exclude_modules"])
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_algo"] == "FP8"
    # generation defaults: the same stop ids, pad id, chat template and sampling defaults
    (_, tok_src), (_, tok_dst) = hybrid.load(source, progress=False), hybrid.load(dst, progress=False)
    assert tok_dst.stop_ids == tok_src.stop_ids == [2, 4, 5]
    assert tok_dst.pad_token_id == tok_src.pad_token_id and tok_dst.chat_template == tok_src.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert tok_dst.apply_chat_template(messages) == tok_src.apply_chat_template(messages)
    sampling = json.loads((dst / "generation_config.json").read_text())
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.6, 0.95, 20)
    # saving the quantized model again does not stack a second section; a source without a card gets one
    again = hybrid.save_checkpoint(hybrid.load_model(dst), tmp_path / "again", source=dst)
    assert (again / "README.md").read_text() == card
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in source.iterdir():
        if p.name != "README.md":
            (bare / p.name).write_bytes(p.read_bytes())
    quantize_checkpoint(bare, tmp_path / "bare-fp8", "fp8")
    card = (tmp_path / "bare-fp8" / "README.md").read_text()
    assert "FP8" in card and str(bare) in card and "hybrid" in card
