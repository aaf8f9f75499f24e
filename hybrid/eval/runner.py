"""Run recall tasks on a model and append one JSONL record per sample; resumable.

A plan is a grid: task x context length x depth (for tasks with a depth axis) x sample seed. Samples of
the same task and length are run together in batches (left-padded; rows do not interact). Generation is
greedy with the task's answer budget and stops at the tokenizer's stop ids; the prefill goes in chunks of
`prefill_chunk_size` tokens, so memory is bounded by the chunk, the constant Mamba state and the KV cache
of the attention layers (which grows with the context). Teacher-forced tasks (MQAR) run the prompt and
the continuation through the same chunked path and read the argmax at each answer token.

Record fields: model, task, context_length (the requested prompt length in tokens), depth_percent
(None for random positions), seed, prompt_tokens (actual), prediction (text; a list of values for
teacher-forced tasks), references, score (0..1, `hybrid.eval.scoring`), metric, needle_depths,
new_tokens, finish_reason, plus any `extra` fields (checkpoint, dtype). A record's identity is
(model, task, context_length, depth_percent, seed): records already in the file are skipped. The file is
append-only (never rewritten, so a resume never loses records): a torn last line of an interrupted run is
warned about when read and truncated away in place before the next append.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

from hybrid.eval.forward import logits_at
from hybrid.eval.registry import expand_tasks, get_task
from hybrid.eval.sample import Sample
from hybrid.eval.scoring import score
from hybrid.eval.tasks import fit_to_length, teacher_forced_pieces
from hybrid.generate import PREFILL_CHUNK_SIZE, generate_ids
from hybrid.sampling import SamplingParams

DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)


@dataclass(frozen=True)
class Job:
    """One sample to run: depth_percent is None for tasks without a depth axis."""

    task: str
    context_length: int
    depth_percent: float | None
    seed: int

    def key(self, model: str) -> tuple:
        return (model, self.task, self.context_length, self.depth_percent, self.seed)


@dataclass
class Plan:
    """The grid to evaluate.

    tasks: task names or groups (`hybrid.eval.registry.GROUPS`).
    lengths: prompt lengths in tokens. depths: needle depths in % for tasks with a depth axis.
    samples: samples per cell, with seeds seed, seed + 1, ...
    max_new_tokens: overrides every task's answer budget when set.
    task_options: per task, options for its generator (e.g. {"kv_recall": {"n_queries": 8}}).
    """

    tasks: list[str]
    lengths: list[int]
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    samples: int = 5
    seed: int = 0
    max_new_tokens: int | None = None
    batch_size: int = 4
    prefill_chunk_size: int = PREFILL_CHUNK_SIZE
    task_options: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        self.tasks = expand_tasks(list(self.tasks))
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        if not self.lengths or any(int(n) < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive token counts, got {self.lengths}")
        if any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"depths must be percentages in [0, 100], got {self.depths}")
        for name, value in (("samples", self.samples), ("batch_size", self.batch_size),
                            ("prefill_chunk_size", self.prefill_chunk_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        unknown = set(self.task_options) - set(self.tasks)
        if unknown:
            raise ValueError(f"task_options name tasks not in the plan: {sorted(unknown)}")

    def jobs(self) -> list[Job]:
        out = []
        for task in self.tasks:
            depths = [float(d) for d in self.depths] if get_task(task).uses_depth else [None]
            for length in self.lengths:
                for depth in depths:
                    out += [Job(task, int(length), depth, self.seed + i) for i in range(self.samples)]
        return out

    def budget(self, task: str) -> int:
        return self.max_new_tokens or get_task(task).max_new_tokens


def record_key(record: dict) -> tuple:
    depth = record.get("depth_percent")
    return (record["model"], record["task"], int(record["context_length"]),
            None if depth is None else float(depth), int(record["seed"]))


def read_records(path: str | Path) -> list[dict]:
    """Records of a JSONL file ([] if it does not exist); a torn last line (an interrupted run) is skipped.

    Raises:
        ValueError: a line before the last is not JSON, or a line is not a record (an object whose model,
            task, context_length, depth_percent and seed make a `record_key`); the message names the line.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, nested too deeply, an integer too long
            if i == len(lines) - 1:
                warnings.warn(f"{path}: skipping a truncated last line (interrupted run)", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
        try:
            if not isinstance(record, dict):
                raise TypeError
            record_key(record)
        except (TypeError, KeyError, ValueError, OverflowError):
            raise ValueError(f"{path}: line {i + 1} is not a result record (an object with model, task, "
                             "context_length, depth_percent and seed)") from None
        records.append(record)
    return records


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a write interrupted mid-record) so appends start clean. The file
    is truncated in place, never rewritten, so the records before the torn line cannot be lost."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def make_sample(job: Job, tokenizer, options: dict | None = None) -> Sample:
    """The sample of `job`, fitted to its context length with `tokenizer`."""
    return fit_to_length(job.task, tokenizer, job.context_length, job.seed, job.depth_percent, **(options or {}))


def generate_answers(model, tokenizer, samples: list[Sample], max_new_tokens: int, prefill_chunk_size: int):
    """Greedy continuations of a batch of prompts: [(text, new_tokens, finish_reason)]."""
    ids = [tokenizer.encode(s.prompt) for s in samples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    completions = generate_ids(model, ids, max_new_tokens, SamplingParams(), tokenizer.stop_ids, pad,
                               prefill_chunk_size)
    out = []
    for c in completions:
        body = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        out.append((tokenizer.decode(body), len(c.token_ids), c.finish_reason))
    return out


def _teacher_forced_ids(tokenizer, sample: Sample) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of prompt + continuation (piece by piece) and the [start, end) span of each answer."""
    ids = list(tokenizer.encode(sample.prompt))
    spans = []
    for text, is_answer in teacher_forced_pieces(sample):
        piece = tokenizer.encode(text, add_special_tokens=False)
        if is_answer:
            spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, spans


def teacher_forced_answers(model, tokenizer, samples: list[Sample], prefill_chunk_size: int) -> list[list[str]]:
    """For each sample, the greedy (argmax) prediction of every answer span given the true tokens before it
    (`hybrid.eval.forward.logits_at`: chunked, only the answer positions reach the LM head)."""
    encoded = [_teacher_forced_ids(tokenizer, s) for s in samples]
    positions = [[t - 1 for a, b in spans for t in range(a, b)] for _, spans in encoded]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    logits = logits_at(model, [ids for ids, _ in encoded], positions, prefill_chunk_size, pad)
    out = []
    for (_, spans), row in zip(encoded, logits):
        best = iter(row.argmax(-1).tolist())
        out.append([tokenizer.decode([next(best) for _ in range(a, b)]) for a, b in spans])
    return out


def evaluate(model, tokenizer, plan: Plan, out_path: str | Path, label: str, extra: dict | None = None,
             progress: bool = True, on_too_short: str = "skip") -> list[dict]:
    """Run every job of `plan` not yet in `out_path` for model `label`; append and return the new records.

    on_too_short: "skip" (warn and leave the cell empty) or "raise", for a (task, length) whose shortest
        prompt is longer than the length (e.g. RULER cwe below ~1K tokens).
    Raises:
        ValueError: on_too_short is "raise" and a length is too short, or an unknown on_too_short.
    """
    from tqdm import tqdm

    if on_too_short not in ("skip", "raise"):
        raise ValueError(f"on_too_short must be 'skip' or 'raise', got {on_too_short!r}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {record_key(r) for r in read_records(out_path)}
    _drop_torn_tail(out_path)
    todo = [job for job in plan.jobs() if job.key(label) not in done]
    new: list[dict] = []
    bar = tqdm(total=len(todo), desc=label, unit="sample", disable=not progress, dynamic_ncols=True, file=sys.stderr)
    too_short: set[tuple[str, int]] = set()
    with out_path.open("a") as f:
        for (task, length), cell in groupby(todo, key=lambda j: (j.task, j.context_length)):
            cell = list(cell)
            spec = get_task(task)
            options = plan.task_options.get(task, {})
            for start in range(0, len(cell), plan.batch_size):
                jobs = cell[start:start + plan.batch_size]
                samples = [make_sample(job, tokenizer, options) for job in jobs]
                if any(s.meta["prompt_tokens"] > length for s in samples):
                    shortest = min(s.meta["prompt_tokens"] for s in samples)
                    message = (f"task {task!r}: context_length {length} is too short "
                               f"(its shortest prompt has {shortest} tokens)")
                    if on_too_short == "raise":
                        raise ValueError(message)
                    if (task, length) not in too_short:
                        too_short.add((task, length))
                        tqdm.write(f"skipping: {message}", file=sys.stderr)
                    bar.update(len(jobs))
                    continue
                if spec.teacher_forced:
                    answers = teacher_forced_answers(model, tokenizer, samples, plan.prefill_chunk_size)
                    results = [(a, 0, "teacher_forced") for a in answers]
                else:
                    results = generate_answers(model, tokenizer, samples, plan.budget(task), plan.prefill_chunk_size)
                for job, sample, (prediction, n_new, finish) in zip(jobs, samples, results):
                    record = {
                        "model": label, "task": task, "context_length": length, "depth_percent": job.depth_percent,
                        "seed": job.seed, "prompt_tokens": sample.meta["prompt_tokens"], "prediction": prediction,
                        "references": sample.answers, "score": score(spec.metric, prediction, sample.answers),
                        "metric": spec.metric, "needle_depths": sample.meta.get("needle_depths"),
                        "new_tokens": n_new, "finish_reason": finish, **(extra or {}),
                    }
                    f.write(json.dumps(record) + "\n")
                    new.append(record)
                f.flush()
                bar.update(len(jobs))
                bar.set_postfix(task=task, length=length, mean=f"{sum(r['score'] for r in new) / len(new):.2f}")
    bar.close()
    return new
