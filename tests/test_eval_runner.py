"""The recall runner end to end on tiny checkpoints made here: records, pivots, summary, PNGs, resume,
comparisons; predictions checked against independent generation / forward passes, scores against what the
predictions imply, tables against the records."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import hybrid
from hybrid.eval import runner
from hybrid.eval.command import main, parse_options
from hybrid.eval.forward import logits_at
from hybrid.eval.report import write_report
from hybrid.eval.tasks import fit_to_length
from tiny_checkpoint import write_checkpoint

PUNCT = ".,;:!?\"'()[]{}<>`"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_ckpts")
    return write_checkpoint(root / "hybrid", "M*E-", seed=0), write_checkpoint(root / "mamba", "MME-", seed=1)


def implied_score(record: dict) -> float:
    """The score a record's prediction implies, computed here from the metric's definition."""
    pred, refs = record["prediction"], record["references"]
    if record["metric"] == "exact_match":
        words = pred.split()
        return float(bool(words) and words[0].strip(PUNCT).lower() in [r.lower() for r in refs])
    if record["metric"] == "string_match_all":
        return sum(r.lower() in pred.strip().lower() for r in refs) / len(refs)
    if record["metric"] == "mqar_accuracy":
        return sum(p == r for p, r in zip(pred, refs)) / len(refs)
    raise AssertionError(record["metric"])


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


ARGS = ["--tasks", "passkey", "niah_single_1", "mqar", "--lengths", "400", "600", "--depths", "0", "100",
        "--samples", "2", "--batch-size", "3", "--max-new-tokens", "4", "--no-progress"]


def test_end_to_end_single_checkpoint(checkpoints, tmp_path):
    ckpt, _ = checkpoints
    out = tmp_path / "run"
    assert main([str(ckpt), "--out", str(out), *ARGS]) == 0
    records = read(out / "records.jsonl")
    assert len(records) == 2 * 2 * 2 + 2 * 2 * 2 + 2 * 2  # passkey, niah_single_1 (x depths), mqar
    keys = {runner.record_key(r) for r in records}
    assert len(keys) == len(records)
    for r in records:
        assert {"task", "context_length", "depth_percent", "seed", "prediction", "references", "score"} <= set(r)
        assert r["model"] == "hybrid" and r["prompt_tokens"] <= r["context_length"]
        assert r["score"] == pytest.approx(implied_score(r))
        assert (r["depth_percent"] is None) == (r["task"] == "mqar")

    model, tok = hybrid.load(ckpt)
    # generated predictions equal a batch-of-one greedy generation of the same prompt
    for r in [x for x in records if x["task"] != "mqar"][::7]:
        sample = fit_to_length(r["task"], tok, r["context_length"], r["seed"], r["depth_percent"])
        assert sample.answers == r["references"]
        [c] = hybrid.generate(model, tok, sample.prompt, max_new_tokens=4)
        assert c.text == r["prediction"]
    # teacher-forced predictions equal the argmax of one full forward over prompt + continuation
    for r in [x for x in records if x["task"] == "mqar"][:2]:
        sample = fit_to_length("mqar", tok, r["context_length"], r["seed"], None)
        ids, spans = list(tok.encode(sample.prompt)), []
        for text, is_answer in sample.meta["pieces"]:
            piece = tok.encode(text, add_special_tokens=False)
            if is_answer:
                spans.append((len(ids), len(ids) + len(piece)))
            ids += piece
        best = model(torch.tensor([ids]))[0].argmax(-1)
        assert r["prediction"] == [tok.decode(best[a - 1:b - 1].tolist()) for a, b in spans]

    # the pivots hold the mean scores of the records
    with (out / "passkey.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["model", "depth_percent", "400", "600"]
    for row in rows[1:]:
        for length, cell in zip((400, 600), row[2:]):
            scores = [r["score"] for r in records if r["task"] == "passkey" and r["context_length"] == length
                      and (row[1] == "all" or r["depth_percent"] == float(row[1]))]
            assert float(cell) == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    summary = (out / "summary.md").read_text()
    assert "| passkey | hybrid |" in summary and "effective (>85.6)" in summary
    for name in ("heatmap_passkey.png", "heatmap_niah_single_1.png", "accuracy_vs_length.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert not (out / "heatmap_mqar.png").exists()

    # resume: nothing new; then only the removed records come back, identical
    main([str(ckpt), "--out", str(out), *ARGS])
    assert read(out / "records.jsonl") == records
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-3]) + lines[-3][:20])  # and a torn last line
    with pytest.warns(UserWarning, match="truncated last line"):
        main([str(ckpt), "--out", str(out), *ARGS])
    assert read(out / "records.jsonl") == records


def test_scores_and_tables_follow_predictions(checkpoints, tmp_path, monkeypatch):
    """With answers forced right for even seeds and wrong for odd ones, every table shows 0.5."""
    ckpt, _ = checkpoints
    _, tok = hybrid.load(ckpt)
    calls = []

    def fake_generate(model, tokenizer, samples, budget, chunk):
        calls.append(len(samples))
        return [(f" {s.answers[0]}." if s.meta["seed"] % 2 == 0 else " 0.", 3, "stop") for s in samples]

    original_make = runner.make_sample

    def make_and_tag(job, tokenizer, options=None):
        s = original_make(job, tokenizer, options)
        s.meta["seed"] = job.seed
        return s

    monkeypatch.setattr(runner, "generate_answers", fake_generate)
    monkeypatch.setattr(runner, "make_sample", make_and_tag)
    plan = runner.Plan(["passkey", "needle"], [400, 500], depths=[0, 50, 100], samples=4, batch_size=5)
    records = runner.evaluate(None, tok, plan, tmp_path / "records.jsonl", "m", progress=False)
    assert len(records) == 2 * 2 * 3 * 4 and max(calls) == 5
    assert [r["score"] for r in records] == [float(r["seed"] % 2 == 0) for r in records]
    report = write_report(tmp_path)
    assert "| passkey | m | 50.0 | 50.0 | 50.0 | - |" in report.summary_text
    with (tmp_path / "needle.csv").open() as f:
        assert all(cell == "0.5000" for row in list(csv.reader(f))[1:] for cell in row[2:])


def test_comparison_of_two_checkpoints(checkpoints, tmp_path):
    a, b = checkpoints
    out = tmp_path / "cmp"
    main([str(a), str(b), "--labels", "hyb", "mam", "--out", str(out), "--tasks", "passkey", "--lengths", "400",
          "--depths", "50", "--samples", "1", "--no-progress"])
    records = read(out / "records.jsonl")
    assert [r["model"] for r in records] == ["hyb", "mam"]
    assert [r["checkpoint"] for r in records] == [str(a), str(b)]
    summary = (out / "summary.md").read_text()
    assert "| passkey | hyb |" in summary and "| passkey | mam |" in summary and "| passkey | mam - hyb |" in summary
    a_score, b_score = (100 * r["score"] for r in records)
    assert f"| passkey | mam - hyb | {b_score - a_score:+.1f} |" in summary
    assert (out / "heatmap_passkey.png").exists() and (out / "accuracy_vs_length.png").exists()


def test_too_short_lengths_are_skipped_or_refused(checkpoints, tmp_path):
    ckpt, _ = checkpoints
    model, tok = hybrid.load(ckpt)
    plan = runner.Plan(["niah_single_1"], [100], depths=[50], samples=1)
    assert runner.evaluate(model, tok, plan, tmp_path / "r.jsonl", "m", progress=False) == []
    with pytest.raises(ValueError, match="context_length 100 is too short"):
        runner.evaluate(model, tok, plan, tmp_path / "r.jsonl", "m", progress=False, on_too_short="raise")


def test_forwards_never_exceed_the_prefill_chunk(checkpoints, tmp_path):
    """Long prompts go through the model in chunks of prefill_chunk_size tokens (bounded attention memory),
    for generation and for teacher forcing alike."""
    ckpt, _ = checkpoints
    model, tok = hybrid.load(ckpt)
    seen = []
    model.backbone.embeddings.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    plan = runner.Plan(["passkey", "mqar"], [600], depths=[50], samples=1, max_new_tokens=2, prefill_chunk_size=64)
    records = runner.evaluate(model, tok, plan, tmp_path / "r.jsonl", "m", progress=False)
    assert [r["task"] for r in records] == ["passkey", "mqar"] and all(r["prompt_tokens"] > 500 for r in records)
    assert max(seen) == 64 and seen.count(64) >= 2 * (500 // 64)


def test_logits_at_equals_full_forward(checkpoints):
    ckpt, _ = checkpoints
    model = hybrid.load_model(ckpt)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (37, 23, 50)]
    positions = [[0, 5, 36, 20], [22, 1], list(range(50))]
    got = logits_at(model, seqs, positions, chunk_size=7)
    for seq, pos, logits in zip(seqs, positions, got):
        want = model(torch.tensor([seq]))[0, pos]
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"positions\[1\] must lie in"):
        logits_at(model, seqs, [[0], [23], [0]])


def test_plan_and_option_errors():
    with pytest.raises(ValueError, match="lengths must be positive"):
        runner.Plan(["passkey"], [0])
    with pytest.raises(ValueError, match="depths must be percentages"):
        runner.Plan(["passkey"], [100], depths=[101])
    with pytest.raises(ValueError, match="task_options name tasks not in the plan"):
        runner.Plan(["passkey"], [100], task_options={"kv_recall": {"n_queries": 2}})
    assert parse_options(["kv_recall.n_queries=8", "ruler_vt.icl=False", "niah_single_1.haystack=needle"]) == {
        "kv_recall": {"n_queries": 8}, "ruler_vt": {"icl": False}, "niah_single_1": {"haystack": "needle"}}
    with pytest.raises(ValueError, match="TASK.KEY=VALUE"):
        parse_options(["n_queries=8"])


def test_cutting_a_torn_tail_keeps_the_records_even_if_it_fails(tmp_path, monkeypatch):
    """records.jsonl stays append-only: a torn last line is cut in place (truncated), never by rewriting the
    file, so a failure while cutting (a full disk) cannot lose the records before it."""
    from pathlib import Path

    path = tmp_path / "records.jsonl"
    rows = [{"model": "m", "task": "t", "context_length": 8, "depth_percent": None, "seed": i} for i in range(3)]
    good = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(good + '{"model": "m", "i"')

    def failing_write_bytes(self, data):  # opens (and so empties) the file, then the disk is full
        self.open("wb").close()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", failing_write_bytes)
    runner._drop_torn_tail(path)
    assert path.read_text() == good
    runner._drop_torn_tail(path)  # nothing to cut
    assert path.read_text() == good and runner.read_records(path) == rows


@pytest.mark.parametrize("line", ['[1, 2]', '{"model": "m"}', '{"model": "m", "task": "t", "context_length": "x", '
                                  '"seed": 0}', "[" * 100000 + "]" * 100000, "1" * 5000])
def test_a_line_that_is_not_a_record_is_named(tmp_path, line):
    """A results file edited by hand or by another tool: a clear error naming the line, never a KeyError,
    TypeError or RecursionError from inside."""
    path = tmp_path / "records.jsonl"
    path.write_text(line + "\n" + json.dumps({"model": "m", "task": "t", "context_length": 8, "seed": 0}) + "\n")
    with pytest.raises(ValueError, match=f"{path}: line 1 is not"):
        runner.read_records(path)
