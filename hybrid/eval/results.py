"""Tables from runner records: a CSV pivot per task and a summary with RULER's effective length.

- `{task}.csv`: rows (model, depth_percent), columns context lengths, cells the mean score (0..1); depth
  "all" is the mean over every sample of the length (the only row for tasks without a depth axis).
- `summary.csv` / `summary.md`: rows (task, model), columns context lengths with the mean score in percent
  (RULER's scale), the average over lengths, and the effective length (`scoring.effective_length`). With
  several models, the markdown table adds per task a row of differences of each later model minus the first.

Each file is written atomically (`hybrid.atomic`): a failed write leaves the previous table.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path

from hybrid.atomic import atomic_write_text
from hybrid.eval.scoring import EFFECTIVE_LENGTH_THRESHOLD, effective_length


def write_csv(path: Path, rows: list[list]) -> None:
    """Write `rows` (the header first) as a CSV file, atomically."""
    buffer = io.StringIO(newline="")
    w = csv.writer(buffer)
    for row in rows:
        w.writerow(row)
    atomic_write_text(path, buffer.getvalue())


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def models_of(records: list[dict]) -> list[str]:
    return _ordered(r["model"] for r in records)


def tasks_of(records: list[dict]) -> list[str]:
    return _ordered(r["task"] for r in records)


def lengths_of(records: list[dict]) -> list[int]:
    return sorted({int(r["context_length"]) for r in records})


def mean_scores(records: list[dict], by_depth: bool = False) -> dict[tuple, float]:
    """Mean score per (model, task, context_length) or per (model, task, context_length, depth_percent)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        key = (r["model"], r["task"], int(r["context_length"]))
        if by_depth:
            key += (r.get("depth_percent"),)
        groups[key].append(float(r["score"]))
    return {k: sum(v) / len(v) for k, v in groups.items()}


def depth_grid(records: list[dict], model: str, task: str) -> tuple[list[float], list[int], list[list[float | None]]]:
    """(depths, lengths, grid[depth][length] mean score or None) for one model and task."""
    rows = [r for r in records if r["model"] == model and r["task"] == task and r.get("depth_percent") is not None]
    depths = sorted({float(r["depth_percent"]) for r in rows})
    lengths = sorted({int(r["context_length"]) for r in rows})
    means = mean_scores(rows, by_depth=True)
    grid = [[means.get((model, task, n, d)) for n in lengths] for d in depths]
    return depths, lengths, grid


def write_task_pivots(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Write `{task}.csv` for every task in `records`; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_length = mean_scores(records)
    by_depth = mean_scores(records, by_depth=True)
    paths = []
    for task in tasks_of(records):
        rows = [r for r in records if r["task"] == task]
        lengths = lengths_of(rows)
        table = [["model", "depth_percent"] + lengths]
        for model in models_of(rows):
            depths = sorted({float(r["depth_percent"]) for r in rows
                             if r["model"] == model and r.get("depth_percent") is not None})
            for d in depths:
                table.append([model, d] + [_fmt(by_depth.get((model, task, n, d))) for n in lengths])
            table.append([model, "all"] + [_fmt(by_length.get((model, task, n))) for n in lengths])
        path = out_dir / f"{task}.csv"
        write_csv(path, table)
        paths.append(path)
    return paths


def _fmt(value: float | None, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def summary_rows(records: list[dict], threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> list[dict]:
    """One row per (task, model): {"task", "model", "percent": {length: %}, "average", "effective_length"}."""
    means = mean_scores(records)
    rows = []
    for task in tasks_of(records):
        for model in models_of(records):
            percent = {n: round(100 * m, 2) for (mo, t, n), m in sorted(means.items()) if mo == model and t == task}
            if not percent:
                continue
            rows.append({"task": task, "model": model, "percent": percent,
                         "average": round(sum(percent.values()) / len(percent), 2),
                         "effective_length": effective_length(percent, threshold)})
    return rows


def write_summary(records: list[dict], out_dir: str | Path,
                  threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> tuple[Path, Path, str]:
    """Write summary.csv and summary.md; return their paths and the markdown text."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(records, threshold)
    lengths = lengths_of(records)
    csv_path = out_dir / "summary.csv"
    write_csv(csv_path, [["task", "model"] + lengths + ["average", "effective_length"]]
              + [[row["task"], row["model"]] + [_fmt(row["percent"].get(n), 2) for n in lengths]
                 + [f"{row['average']:.2f}", row["effective_length"] or ""] for row in rows])
    text = markdown_summary(rows, lengths, threshold)
    md_path = out_dir / "summary.md"
    atomic_write_text(md_path, text)
    return csv_path, md_path, text


def markdown_summary(rows: list[dict], lengths: list[int], threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> str:
    """The summary as a markdown table (scores in percent; "-" where a cell was not run)."""
    def length_name(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    head = ["task", "model"] + [length_name(n) for n in lengths] + ["avg", f"effective (>{threshold})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    models = _ordered(r["model"] for r in rows)
    for task in _ordered(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        for r in task_rows:
            cells = [_fmt(r["percent"].get(n), 1) or "-" for n in lengths]
            eff = r["effective_length"]
            lines.append("| " + " | ".join([task, r["model"]] + cells + [f"{r['average']:.1f}",
                                                                          length_name(eff) if eff else "-"]) + " |")
        if len(models) >= 2 and len(task_rows) >= 2:
            a = task_rows[0]
            for b in task_rows[1:]:
                diffs = [f"{b['percent'][n] - a['percent'][n]:+.1f}" if n in a["percent"] and n in b["percent"]
                         else "-" for n in lengths]
                lines.append("| " + " | ".join([task, f"{b['model']} - {a['model']}"] + diffs
                                               + [f"{b['average'] - a['average']:+.1f}", ""]) + " |")
    return "\n".join(lines) + "\n"
