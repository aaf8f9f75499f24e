"""MTP self-speculative decoding against plain decoding, in one run: acceptance rate and decode speed.

    python scripts/bench_speculative.py [CHECKPOINT] --num-draft 1 2 3 --max-new-tokens 128

For each prompt (prose openings and recall prompts, whose answers the MTP block drafts well), greedy
decoding with `hybrid.generate.generate_ids`, without and with `speculative=N` (the engine's MTP drafts) at
each draft length. Reports the acceptance rate (accepted / drafted), decode tokens/s (medians over
`--repeats`), the speedup, and checks the tokens are identical. Prints a table, writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from hybrid.atomic import atomic_write_text
from hybrid.cli import DEFAULT_CHECKPOINT
from hybrid.eval.tasks import fit_to_length
from hybrid.generate import generate_ids
from hybrid.loading import load

PROSE = [
    "The for statement is used to iterate over the elements of a sequence",
    "Exceptions are raised when an error is detected during execution. The",
    "A class definition defines a class object. The class name is bound",
    "The import statement finds a module, loads and initializes it if",
]


def write_json(path: Path, content, indent: int = 1) -> None:
    """Write `content` as JSON to `path` atomically (`hybrid.atomic`: a failed write leaves the previous file)."""
    atomic_write_text(path, json.dumps(content, indent=indent, default=str) + "\n")


def prompts(tokenizer) -> list[tuple[str, list[int]]]:
    out = [("prose", tokenizer.encode(text)) for text in PROSE]
    for task in ("passkey", "kv_recall"):
        sample = fit_to_length(task, tokenizer, 400, seed=7, depth_percent=50.0)
        out.append((task, tokenizer.encode(sample.prompt)))
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--num-draft", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("speculative_bench.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.checkpoint, dtype=args.dtype)
    stop = tokenizer.stop_ids

    rows, identical = [], True
    for kind, ids in prompts(tokenizer):
        runs = [generate_ids(model, [ids], args.max_new_tokens, stop_ids=stop)[0] for _ in range(args.repeats)]
        plain_tps = statistics.median(c.decode_tokens_per_s or 0.0 for c in runs)
        row = {"prompt": kind, "prompt_tokens": len(ids), "generated": len(runs[0].token_ids),
               "plain_decode_tok_s": plain_tps}
        for n in args.num_draft:
            spec = [generate_ids(model, [ids], args.max_new_tokens, stop_ids=stop, speculative=n)[0]
                    for _ in range(args.repeats)]
            identical &= all(c.token_ids == runs[0].token_ids for c in spec)
            tps = statistics.median(c.decode_tokens_per_s or 0.0 for c in spec)
            row[f"n{n}_acceptance"] = spec[0].acceptance_rate
            row[f"n{n}_decode_tok_s"] = tps
            row[f"n{n}_speedup"] = tps / plain_tps if plain_tps else None
        rows.append(row)

    summary = {"checkpoint": args.checkpoint, "threads": torch.get_num_threads(), "dtype": str(model.dtype),
               "max_new_tokens": args.max_new_tokens, "identical_tokens": identical, "rows": rows}
    for n in args.num_draft:
        summary[f"n{n}_mean_acceptance"] = statistics.mean(r[f"n{n}_acceptance"] for r in rows)
        summary[f"n{n}_median_speedup"] = statistics.median(r[f"n{n}_speedup"] for r in rows)
    write_json(args.out, summary)

    head = f"{'prompt':10} {'tokens':>6} {'plain tok/s':>11}" + "".join(
        f" {'n=' + str(n) + ' acc':>9} {'tok/s':>7} {'x':>5}" for n in args.num_draft)
    print(head)
    for r in rows:
        print(f"{r['prompt']:10} {r['prompt_tokens']:6d} {r['plain_decode_tok_s']:11.1f}" + "".join(
            f" {r[f'n{n}_acceptance']:9.2f} {r[f'n{n}_decode_tok_s']:7.1f} {r[f'n{n}_speedup']:5.2f}"
            for n in args.num_draft))
    print(f"identical tokens with and without speculation: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
