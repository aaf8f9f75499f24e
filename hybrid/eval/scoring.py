"""Scores of one prediction against its references (0..1), and the RULER aggregates.

- `string_match_all` / `string_match_part`: RULER's metrics (Hsieh et al. 2024; NVIDIA/RULER
  `scripts/eval/synthetic/constants.py`): the fraction of the references found in the prediction
  (case-insensitive substring), or whether any is found. RULER averages them over samples and reports
  percentages (`ruler_percent`); per sample they are 0..1 here, as lm-evaluation-harness reports them.
- `exact_match`: the first word of the prediction, stripped of surrounding punctuation, equals a reference
  (passkey retrieval's score, Mohtashami & Jaggi 2023: the number the model writes is the key).
- `mqar_accuracy`: the fraction of queried values predicted exactly (teacher-forced MQAR, Zoology).
- `effective_length`: the longest length up to which every score stays above RULER's threshold 85.6
  (the score of Llama-2-7B at 4K in the RULER paper).
"""

from __future__ import annotations

import re

EFFECTIVE_LENGTH_THRESHOLD = 85.6
_CONTROL = re.compile(r"[\x00-\x1f]")
_PUNCT = ".,;:!?\"'()[]{}<>`"


def postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _check_refs(references: list[str]) -> None:
    if not references:
        raise ValueError("references must be a non-empty list of strings")


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of `references` that occur in `prediction` (case-insensitive)."""
    _check_refs(references)
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any of `references` occurs in `prediction` (case-insensitive), else 0.0."""
    _check_refs(references)
    pred = postprocess(prediction).lower()
    return float(any(r.lower() in pred for r in references))


def first_word(prediction: str) -> str:
    """The first whitespace-separated word of `prediction` without surrounding punctuation ("" if none)."""
    words = postprocess(prediction).split()
    return words[0].strip(_PUNCT) if words else ""


def exact_match(prediction: str, references: list[str]) -> float:
    """1.0 if the first word of `prediction` (punctuation stripped) equals a reference (case-insensitive)."""
    _check_refs(references)
    return float(first_word(prediction).lower() in {r.lower() for r in references})


def mqar_accuracy(predictions: list[str], references: list[str]) -> float:
    """Fraction of positions where the predicted value equals the reference value (whitespace stripped)."""
    _check_refs(references)
    if len(predictions) != len(references):
        raise ValueError(f"predictions ({len(predictions)}) and references ({len(references)}) differ in length")
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


METRICS = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "exact_match": exact_match,
    "mqar_accuracy": mqar_accuracy,
}


def score(metric: str, prediction, references: list[str]) -> float:
    """The score (0..1) of one prediction under `metric` (a key of `METRICS`)."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is unknown; expected one of {sorted(METRICS)}")
    return METRICS[metric](prediction, references)


def ruler_percent(scores: list[float]) -> float:
    """RULER's aggregate: the mean of per-sample scores x 100, rounded to 2 decimals."""
    if not scores:
        raise ValueError("scores must be non-empty")
    return round(100 * sum(scores) / len(scores), 2)


def effective_length(percent_by_length: dict[int, float],
                     threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> int | None:
    """The longest length L such that the score at every tested length <= L exceeds `threshold` (percent);
    None when the shortest length already fails."""
    best = None
    for length in sorted(percent_by_length):
        if percent_by_length[length] > threshold:
            best = length
        else:
            break
    return best
