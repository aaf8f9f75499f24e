"""scripts/recall_study.py: the MQAR generator, and a reduced study in which the hybrid (Mamba-2 + attention)
must recall far better than pure Mamba-2 whose state is over capacity (Zoology, Arora et al. 2023)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "recall_study.py"


@pytest.fixture(scope="module")
def rs():
    spec = importlib.util.spec_from_file_location("recall_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["recall_study"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def batch(rs, seed, n=64, pairs=8, seq_len=48, vocab=64):
    return rs.mqar_batch(n, pairs, seq_len, vocab, torch.Generator().manual_seed(seed))


def test_mqar_answers_are_the_values_of_the_queried_keys(rs):
    pairs, seq_len, vocab = 8, 48, 64
    inputs, targets = batch(rs, 0, pairs=pairs, seq_len=seq_len, vocab=vocab)
    assert inputs.shape == targets.shape == (64, seq_len)
    for x, y in zip(inputs.tolist(), targets.tolist()):
        keys, values = x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2]
        table = dict(zip(keys, values))
        assert len(set(keys)) == pairs and len(set(values)) == pairs
        assert all(1 <= k < vocab // 2 for k in keys) and all(vocab // 2 <= v < vocab for v in values)
        scored = [t for t, target in enumerate(y) if target != rs.IGNORE]
        assert all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t in scored)  # query slots after the pairs
        assert sorted(x[t] for t in scored) == sorted(keys)  # every key is queried exactly once
        for t in scored:
            assert y[t] == table[x[t]]  # the answer is the value paired with the queried key ...
            assert x[t + 1] == y[t]  # ... written right after the query
        assert all(y[t] == rs.IGNORE for t in range(2 * pairs))  # nothing scored inside the pairs


def test_mqar_is_deterministic_given_the_seed(rs):
    a, b, c = batch(rs, 7), batch(rs, 7), batch(rs, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_mqar_rejects_a_sequence_too_short_for_the_queries(rs):
    with pytest.raises(ValueError, match="4 \\* pairs"):
        rs.mqar_batch(2, 16, 60, 256, torch.Generator().manual_seed(0))


def test_architectures_have_about_the_same_parameter_count(rs):
    counts = [rs.count_params(rs.build(pattern, 64, 16, 256, 64, 0)) for pattern in rs.ARCHS.values()]
    assert max(counts) / min(counts) < 1.15, counts


def test_reduced_study_hybrid_recalls_where_pure_mamba2_cannot(rs, tmp_path):
    """The hybrid learns MQAR within the budget; two Mamba-2 layers with state size 4 cannot hold 16 pairs.

    Each model trains once on a mixture of 4, 8 and 16 pairs (seq_len 64) and is scored at each count.
    Measured on 2 cores: the hybrid reaches about 1.00 by step 300 of 600, Mamba-2 stays near 0.1 at 16
    pairs; each run takes about 40 s (on the slowest CI machine, 2 cores of an AMD EPYC, about 100 s).
    The attention-only architecture is the study's third line but not this claim: it gets its own short
    run below (its records and CSV rows have no state size), not 600 steps of CI time.
    """
    out = tmp_path / "study"
    args = ["--pairs", "4", "8", "16", "--state-sizes", "4", "--archs", "hybrid", "mamba2",
            "--d-model", "64", "--seq-len", "64", "--vocab-size", "128", "--steps", "600", "--batch-size", "64",
            "--lr", "3e-3", "--eval-examples", "500", "--seed", "0", "--threads", "2", "--out", str(out)]
    assert rs.main(args) == 0

    records = read_records(out)
    assert len(records) == 2 * 3
    acc = {(r["arch"], r["pairs"]): r["accuracy"] for r in records}
    print("reduced MQAR study:", {f"{a}@{p}": v for (a, p), v in acc.items()},
          "seconds:", {r["arch"]: r["seconds"] for r in records})
    assert acc["hybrid", 16] >= 0.9, records
    assert acc["hybrid", 16] - acc["mamba2", 16] >= 0.5, records
    assert all(r["state_size"] == 4 for r in records)
    assert_csv_matches(out, records)
    png = (out / "accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_attention_runs_have_no_state_size(rs, tmp_path):
    out = tmp_path / "attention"
    args = ["--pairs", "4", "8", "--state-sizes", "4", "16", "--archs", "attention", "--d-model", "64",
            "--seq-len", "32", "--vocab-size", "64", "--steps", "4", "--batch-size", "8", "--eval-examples", "16",
            "--seed", "0", "--threads", "2", "--out", str(out)]
    assert rs.main(args) == 0
    records = read_records(out)
    # one run for the architecture whatever the state sizes (it has none), scored at each pair count
    assert [(r["arch"], r["pairs"], r["state_size"]) for r in records] == [("attention", 4, None), ("attention", 8, None)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 4 for r in records)
    assert_csv_matches(out, records)


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def assert_csv_matches(out: Path, records: list[dict]) -> None:
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert row["arch"] == record["arch"] and int(row["pairs"]) == record["pairs"]
        assert row["state_size"] == ("" if record["state_size"] is None else str(record["state_size"]))
        assert int(row["params"]) == record["params"] and int(row["steps"]) == record["steps"]
        assert float(row["accuracy"]) == record["accuracy"] and float(row["seconds"]) == record["seconds"]
