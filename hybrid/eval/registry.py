"""The evaluation tasks by name: generator (in `hybrid.eval.tasks.GENERATORS`), metric, answer budget,
whether the needle depth is a grid axis, and whether the task is scored teacher-forced.

Answer budgets are in new tokens and sized for tokenizers that split numbers digit by digit (the default
checkpoint's); RULER itself allows 128 (niah), 30 (vt), 120 (cwe), 50 (fwe). `--max-new-tokens` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.eval.tasks import GENERATORS


@dataclass(frozen=True)
class TaskSpec:
    """How one task is run and scored.

    metric: a key of `hybrid.eval.scoring.METRICS`.
    max_new_tokens: the greedy answer budget (ignored when teacher_forced).
    uses_depth: the needle depth is chosen by the caller (a heatmap axis); otherwise positions are random.
    teacher_forced: scored from the logits at the answer tokens of `sample.continuation` (MQAR).
    """

    name: str
    metric: str
    max_new_tokens: int
    uses_depth: bool
    teacher_forced: bool = False
    description: str = ""


_SPECS = [
    TaskSpec("passkey", "exact_match", 12, True,
             description="passkey retrieval (Mohtashami & Jaggi 2023), 5 digits"),
    TaskSpec("needle", "string_match_all", 16, True,
             description="one word-key / 7-digit needle in the filler (trained format)"),
    TaskSpec("phonebook", "exact_match", 16, True, description="phonebook lookup (Jelassi et al. 2024)"),
    TaskSpec("kv_recall", "exact_match", 8, False, description="key=value pairs, last of 4 lookups scored"),
    TaskSpec("mqar", "mqar_accuracy", 0, False, teacher_forced=True,
             description="multi-query associative recall (Zoology), every lookup scored teacher-forced"),
    TaskSpec("niah_single_1", "string_match_all", 24, True,
             description="RULER niah_single_1: one needle, noise haystack"),
    TaskSpec("niah_multikey_2", "string_match_all", 24, True,
             description="RULER niah_multikey_2: one needle among distractor needles"),
    TaskSpec("niah_multikey_3", "string_match_all", 64, True,
             description="RULER niah_multikey_3: UUID keys and values among distractor needles"),
    TaskSpec("niah_multikey_noise", "string_match_all", 24, False,
             description="4 needles (keys), one asked; noise haystack"),
    TaskSpec("niah_multivalue_noise", "string_match_all", 64, False,
             description="4 values for one key; noise haystack"),
    TaskSpec("niah_multivalue_needle", "string_match_all", 64, False,
             description="4 values for one key; distractor needles"),
    TaskSpec("niah_multiquery_noise", "string_match_all", 64, False,
             description="4 keys asked at once; noise haystack"),
    TaskSpec("niah_multiquery_needle", "string_match_all", 64, False,
             description="4 keys asked at once; distractor needles"),
    TaskSpec("ruler_vt", "string_match_all", 30, False, description="RULER variable tracking: 1 chain, 4 hops"),
    TaskSpec("ruler_cwe", "string_match_all", 120, False, description="RULER common words extraction (top 10)"),
    TaskSpec("ruler_fwe", "string_match_all", 50, False, description="RULER frequent words extraction (top 3)"),
]
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in _SPECS}
assert set(TASKS) == set(GENERATORS), "every generator needs a TaskSpec"

GROUPS = {
    "classic": ["passkey", "needle", "phonebook", "kv_recall", "mqar"],
    "ruler": [name for name in TASKS if name.startswith(("niah_", "ruler_"))],
    "niah": ["passkey", "needle", "niah_single_1"],
}
GROUPS["all"] = list(TASKS)


def get_task(name: str) -> TaskSpec:
    """The spec of task `name`. Raises ValueError naming the known tasks."""
    if name not in TASKS:
        raise ValueError(f"task {name!r} is unknown; expected one of {sorted(TASKS)} or a group {sorted(GROUPS)}")
    return TASKS[name]


def expand_tasks(names: list[str]) -> list[str]:
    """Task names with groups ("ruler", "classic", "niah", "all") expanded, in order, without repeats."""
    out: list[str] = []
    for name in names:
        for task in GROUPS.get(name, [name]):
            get_task(task)
            if task not in out:
                out.append(task)
    return out
