"""Command line of the recall evaluation (`python scripts/eval_recall.py ...` or `python -m hybrid.eval ...`).

    python scripts/eval_recall.py CHECKPOINT [CHECKPOINT ...] --out DIR [--tasks passkey needle ruler ...]
        [--lengths 512 1024 2048] [--depths 0 25 50 75 100] [--samples 5] [--seed 0] [--dtype bf16]
    python scripts/eval_recall.py --report DIR          # tables and plots from DIR/records.jsonl only
    python scripts/eval_recall.py --list-tasks

Several checkpoints (e.g. bf16 and its FP4 copy, or hybrid and pure Mamba) are evaluated on the same
samples, one after the other, into the same records file, and reported side by side. Rerunning the same
command resumes: samples already in DIR/records.jsonl are skipped; a later command with other
checkpoints or labels (e.g. the same FP4 copy with --act-quant --labels fp4-w4a4) adds to the same table.
"""

from __future__ import annotations

import argparse
import ast
import gc
import re
import sys
from pathlib import Path

from hybrid.dtypes import dtype_name
from hybrid.eval.registry import GROUPS, TASKS
from hybrid.eval.report import RECORDS_FILE, write_report
from hybrid.eval.runner import DEFAULT_DEPTHS, Plan, evaluate
from hybrid.eval.scoring import EFFECTIVE_LENGTH_THRESHOLD
from hybrid.generate import PREFILL_CHUNK_SIZE


def parse_options(items: list[str]) -> dict[str, dict]:
    """["kv_recall.n_queries=8", ...] -> {"kv_recall": {"n_queries": 8}}; values are Python literals or strings.

    Raises:
        ValueError: an item not of the form TASK.KEY=VALUE.
    """
    out: dict[str, dict] = {}
    for item in items:
        target, eq, value = item.partition("=")
        task, dot, key = target.partition(".")
        if not (eq and dot and task and key):
            raise ValueError(f"--option must look like TASK.KEY=VALUE, got {item!r}")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        out.setdefault(task, {})[key] = parsed
    return out


def labels_for(checkpoints: list[str], labels: list[str] | None) -> list[str]:
    """`labels` if given (one per checkpoint), else the directory names, made unique."""
    if labels:
        if len(labels) != len(checkpoints):
            raise ValueError(f"--labels needs one label per checkpoint ({len(checkpoints)}), got {len(labels)}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"--labels must be distinct, got {labels}")
        return list(labels)
    out = []
    for path in checkpoints:
        name = Path(path.rstrip("/")).name or path
        label, k = name, 2
        while label in out:
            label, k = f"{name}-{k}", k + 1
        out.append(label)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_recall", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoints", nargs="*", help="checkpoint directories or hub ids (several: a comparison)")
    p.add_argument("--out", help="output directory (records.jsonl, CSVs, summary, PNGs)")
    p.add_argument("--labels", nargs="+",
                   help="one name per checkpoint for tables and plots (default: directory names)")
    p.add_argument("--tasks", nargs="+", default=["passkey", "needle", "niah_single_1"],
                   help=f"tasks or groups ({', '.join(sorted(GROUPS))}); see --list-tasks")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048], help="prompt lengths in tokens")
    p.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS),
                   help="needle depths in %% (tasks with a depth axis)")
    p.add_argument("--samples", type=int, default=5, help="samples per cell (seeds seed, seed+1, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the checkpoint's)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a CUDA device is available, else cpu)")
    p.add_argument("--act-quant", action="store_true",
                   help="quantized checkpoints: also quantize activations (passed to hybrid.load)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget for every task (default: per task)")
    p.add_argument("--batch-size", type=int, default=4, help="samples of one cell run together")
    p.add_argument("--prefill-chunk-size", type=int, default=PREFILL_CHUNK_SIZE,
                   help="prompt tokens per forward")
    p.add_argument("--option", action="append", default=[], metavar="TASK.KEY=VALUE",
                   help="generator option, e.g. kv_recall.n_queries=8 (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--threshold", type=float, default=EFFECTIVE_LENGTH_THRESHOLD,
                   help="effective-length threshold (%%)")
    p.add_argument("--on-too-short", choices=["skip", "raise"], default="skip",
                   help="what to do when a length is shorter than a task's smallest prompt")
    p.add_argument("--report", metavar="DIR", help="only rebuild tables and plots from DIR/records.jsonl")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list-tasks", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_tasks:
        for name, spec in TASKS.items():
            axis = "depth" if spec.uses_depth else ("teacher-forced" if spec.teacher_forced else "random positions")
            print(f"{name:24s} {spec.metric:17s} {axis:16s} {spec.description}")
        for group, names in GROUPS.items():
            print(f"group {group}: {' '.join(names)}")
        return 0
    if args.report:
        try:
            report = write_report(args.report, args.threshold, plots=not args.no_plots)
        except ValueError as e:
            parser.error(f"--report: {e}")
        print(report.summary_text, end="")
        return 0
    if not args.checkpoints or not args.out:
        parser.error("give CHECKPOINT(s) and --out (or --report DIR, or --list-tasks)")
    try:
        plan = Plan(args.tasks, args.lengths, args.depths, args.samples, args.seed, args.max_new_tokens,
                    args.batch_size, args.prefill_chunk_size, parse_options(args.option))
        labels = labels_for(args.checkpoints, args.labels)
    except ValueError as e:
        parser.error(str(e))
    missing = [p for p in args.checkpoints if not Path(p).is_dir() and not re.fullmatch(r"[\w.-]+/[\w.-]+", p)]
    if missing:
        parser.error(f"checkpoints: no such directory (nor a hub id org/name): {', '.join(missing)}")

    import torch

    import hybrid

    if args.threads:
        torch.set_num_threads(args.threads)
    from hybrid.devices import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    for path, label in zip(args.checkpoints, labels):
        load_options = {"act_quant": True} if args.act_quant else {}
        try:
            model, tokenizer = hybrid.load(path, dtype=args.dtype, device=device, **load_options)
        except (hybrid.CheckpointError, hybrid.ConfigError, ValueError) as e:
            parser.exit(1, f"eval_recall: error loading {path}: {e}\n")
        extra = {"checkpoint": str(path), "dtype": dtype_name(model.dtype), **load_options}
        evaluate(model, tokenizer, plan, out / RECORDS_FILE, label, extra, progress=not args.no_progress,
                 on_too_short=args.on_too_short)
        del model
        gc.collect()
    report = write_report(out, args.threshold, plots=not args.no_plots)
    print(report.summary_text, end="")
    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("" if n == 1 else "s")

    print(f"wrote {out / RECORDS_FILE}, {count(len(report.pivots), 'pivot CSV')}, {report.summary_csv.name}, "
          f"{report.summary_md.name}"
          + ("" if args.no_plots else f", {count(len(report.heatmaps), 'heatmap')} and {report.length_plot.name}"),
          file=sys.stderr)
    return 0


def lm_eval_main() -> None:
    """`hybrid-lm-eval` / scripts/lm_eval_hybrid.py: the `lm_eval` command line with the `hybrid` model registered."""
    try:
        from hybrid.eval.lm_eval_adapter import main as run
    except ImportError as e:
        sys.exit(f"lm-evaluation-harness is not installed ({e}); pip install -e \".[eval]\"")
    run()
