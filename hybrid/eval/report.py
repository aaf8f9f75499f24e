"""Everything derived from a records file: per-task CSV pivots, the summary table, the PNG plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybrid.eval.plots import write_heatmaps, write_length_plot
from hybrid.eval.results import write_summary, write_task_pivots
from hybrid.eval.runner import read_records
from hybrid.eval.scoring import EFFECTIVE_LENGTH_THRESHOLD

RECORDS_FILE = "records.jsonl"


@dataclass
class Report:
    pivots: list[Path]
    summary_csv: Path
    summary_md: Path
    summary_text: str
    heatmaps: list[Path]
    length_plot: Path


def write_report(out_dir: str | Path, threshold: float = EFFECTIVE_LENGTH_THRESHOLD, plots: bool = True) -> Report:
    """Read `out_dir/records.jsonl` and write the pivots, summary and (with `plots`) PNGs next to it.

    Raises:
        ValueError: the records file is missing or empty.
    """
    out_dir = Path(out_dir)
    records = read_records(out_dir / RECORDS_FILE)
    if not records:
        raise ValueError(f"{out_dir / RECORDS_FILE}: no records to report")
    pivots = write_task_pivots(records, out_dir)
    csv_path, md_path, text = write_summary(records, out_dir, threshold)
    heatmaps = write_heatmaps(records, out_dir) if plots else []
    length_plot = write_length_plot(records, out_dir, threshold) if plots else None
    return Report(pivots, csv_path, md_path, text, heatmaps, length_plot)
