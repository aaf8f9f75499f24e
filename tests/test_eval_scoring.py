"""Scoring functions on hand-made predictions, against RULER's published formulas and hand counts."""

from __future__ import annotations

import pytest

from hybrid.eval.scoring import (
    effective_length,
    exact_match,
    first_word,
    mqar_accuracy,
    postprocess,
    ruler_percent,
    score,
    string_match_all,
    string_match_part,
)


def ruler_string_match_all(preds, refs):
    """RULER scripts/eval/synthetic/constants.py, as published (percent over a list of samples)."""
    return round(sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                      for pred, ref in zip(preds, refs)]) / len(preds) * 100, 2)


def ruler_string_match_part(preds, refs):
    return round(sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref])
                      for pred, ref in zip(preds, refs)]) / len(preds) * 100, 2)


CASES = [
    (" 1234567.", ["1234567"], 1.0, 1.0),
    (" The numbers are 123 and 456.", ["123", "456", "789"], 2 / 3, 1.0),
    ("nothing here", ["123", "456"], 0.0, 0.0),
    (" HONEST-APPLE is the key", ["honest-apple"], 1.0, 1.0),
    ("1. ring 2. dog 3. cat", ["ring", "dog", "cat", "owl"], 3 / 4, 1.0),
    ("\x00 42 \x1f", ["42"], 1.0, 1.0),
]


@pytest.mark.parametrize("prediction,references,all_,part", CASES)
def test_string_match_hand_counts(prediction, references, all_, part):
    assert string_match_all(prediction, references) == pytest.approx(all_)
    assert string_match_part(prediction, references) == part


def test_aggregates_equal_ruler_formulas():
    preds = [c[0] for c in CASES]
    refs = [c[1] for c in CASES]
    assert ruler_percent([string_match_all(p, r) for p, r in zip(preds, refs)]) == ruler_string_match_all(preds, refs)
    assert ruler_percent([string_match_part(p, r) for p, r in zip(preds, refs)]) == ruler_string_match_part(preds, refs)
    assert ruler_percent([1.0, 0.5, 0.0]) == 50.0


def test_postprocess_like_ruler():
    assert postprocess("  a\tb\x00c  ") == "a\nb\nc"


@pytest.mark.parametrize("prediction,references,expected", [
    (" 12345. Remember it.", ["12345"], 1.0),
    ("12345", ["12345"], 1.0),
    (" 123456.", ["12345"], 0.0),           # a longer number is not the key
    (" The pass key is 12345.", ["12345"], 0.0),  # the number must come first
    (" 364-6289.", ["364-6289"], 1.0),
    ("", ["1"], 0.0),
    (" (Apple),", ["apple"], 1.0),
])
def test_exact_match(prediction, references, expected):
    assert exact_match(prediction, references) == expected


def test_first_word():
    assert first_word("  42. and more") == "42"
    assert first_word("") == ""


def test_mqar_accuracy():
    assert mqar_accuracy(["123", " 456", "000"], ["123", "456", "789"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="differ in length"):
        mqar_accuracy(["1"], ["1", "2"])


def test_score_dispatch_and_errors():
    assert score("exact_match", " 7.", ["7"]) == 1.0
    assert score("string_match_all", "a b", ["a", "c"]) == 0.5
    with pytest.raises(ValueError, match="metric 'bleu' is unknown"):
        score("bleu", "x", ["x"])
    with pytest.raises(ValueError, match="references must be a non-empty"):
        string_match_all("x", [])


def test_effective_length():
    # RULER README row for Command-R-plus: 95.6 95.2 94.2 92.0 84.3 63.1 at 4K..128K -> effective 32K
    row = dict(zip([4096, 8192, 16384, 32768, 65536, 131072], [95.6, 95.2, 94.2, 92.0, 84.3, 63.1]))
    assert effective_length(row) == 32768
    assert effective_length({512: 90.0, 1024: 85.6, 2048: 99.0}) == 512  # must stay above; 85.6 is not above
    assert effective_length({512: 50.0, 1024: 99.0}) is None
    assert effective_length({512: 60.0}, threshold=50.0) == 512
