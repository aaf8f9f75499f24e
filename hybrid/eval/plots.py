"""PNG plots of runner records (matplotlib, Agg backend; matplotlib is needed only here).

- `heatmap_{task}.png` for every task with a depth axis: the needle-in-a-haystack grid (after
  gkamradt/LLMTest_NeedleInAHaystack), rows depth % (0 at the top), columns context length, colour the mean
  score on a fixed 0..1 red-yellow-green scale, the value written in each cell; one panel per model.
- `accuracy_vs_length.png`: one panel per task, mean score vs context length (log2 axis), one line per
  model, RULER's 85.6% threshold dashed.

Each PNG is written atomically (`hybrid.atomic`): a failed write leaves the previous plot.
"""

from __future__ import annotations

import math
from pathlib import Path

from hybrid.atomic import atomic_path
from hybrid.eval.results import depth_grid, lengths_of, mean_scores, models_of, tasks_of
from hybrid.eval.scoring import EFFECTIVE_LENGTH_THRESHOLD


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError('the plots need matplotlib: pip install -e ".[eval]" (or pass --no-plots)') from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def draw_heatmap(ax, depths: list[float], lengths: list[int], grid: list[list[float | None]], title: str):
    """Draw one depth x length grid on `ax`; missing cells are left blank. Returns the image."""
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
    image = ax.imshow(data, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth (%)")
    ax.set_title(title)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="black")
    return image


def write_heatmaps(records: list[dict], out_dir: str | Path) -> list[Path]:
    """`heatmap_{task}.png` for every task whose records carry a depth; one panel per model."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in tasks_of(records):
        rows = [r for r in records if r["task"] == task and r.get("depth_percent") is not None]
        models = models_of(rows)
        if not models:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(1.2 + 1.1 * len(lengths_of(rows)) * len(models), 4.5),
                                 squeeze=False)
        image = None
        for ax, model in zip(axes[0], models):
            depths, lengths, grid = depth_grid(rows, model, task)
            image = draw_heatmap(ax, depths, lengths, grid, f"{task}: {model}")
        fig.colorbar(image, ax=list(axes[0]), label="score", fraction=0.05)
        path = out_dir / f"heatmap_{task}.png"
        _save(plt, fig, path)
        paths.append(path)
    return paths


def write_length_plot(records: list[dict], out_dir: str | Path,
                      threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> Path:
    """`accuracy_vs_length.png`: a panel per task, a line per model."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks, models = tasks_of(records), models_of(records)
    means = mean_scores(records)
    cols = min(4, len(tasks))
    nrows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for model in models:
            points = sorted((n, m) for (mo, t, n), m in means.items() if mo == model and t == task)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
        ax.axhline(threshold / 100, color="gray", linestyle="--", linewidth=1)
        lengths = lengths_of([r for r in records if r["task"] == task])
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(n) for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=max(1, len(models)), bbox_to_anchor=(0.5, 1.0))
    path = out_dir / "accuracy_vs_length.png"
    _save(plt, fig, path)
    return path


def _save(plt, fig, path: Path) -> None:
    """Write `fig` to `path` as a PNG, atomically; the figure is closed either way."""
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
