"""The `Sample` every task generator returns, and the small helpers the generators share."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One task instance.

    prompt: context and question, ending where the answer starts.
    answers: the reference strings a prediction is scored against.
    continuation: the text a perfect model writes right after the prompt (used for training, and scored
        token by token for the teacher-forced tasks such as MQAR).
    depth_percent: the requested depth of the needle, or None when the positions are random.
    meta: task-specific facts: `units` and `prompt_tokens` (set by `fit_to_length`), `needle_depths`
        (where the needles actually are, % of the haystack units before each), `pieces` (teacher-forced
        tasks: the continuation as (text, is_answer) pieces).
    """

    task: str
    prompt: str
    answers: list[str]
    continuation: str
    depth_percent: float | None = None
    meta: dict = field(default_factory=dict)


class CapacityError(ValueError):
    """A generator was asked for more haystack units than its vocabulary can fill."""


def digits(rng: random.Random, n: int) -> str:
    """An `n`-digit number without a leading zero."""
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def insert_at_depth(units: list[str], needle: str, depth_percent: float) -> list[str]:
    """Insert `needle` between units so that `depth_percent` of the units come before it."""
    at = round(len(units) * depth_percent / 100)
    return units[:at] + [needle] + units[at:]


def check_depth(depth_percent: float | None) -> None:
    """Raises ValueError unless `depth_percent` is None or in [0, 100]."""
    if depth_percent is not None and not 0 <= depth_percent <= 100:
        raise ValueError(f"depth_percent must be in [0, 100], got {depth_percent}")
