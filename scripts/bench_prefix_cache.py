"""Time to first token with and without the prefix cache, and what a snapshot costs.

    python scripts/bench_prefix_cache.py                                  # the default checkpoint
    python scripts/bench_prefix_cache.py --config checkpoints/configs/bench-medium.config.json

A long shared prefix (a document: `--prefix-tokens`, default 8192) is followed by a short question
(`--question-tokens`). Measured in one run, on the same model and threads, each a median of `--repeats`:
- cold: a prefill of prefix + question with no cache (what every request pays without one);
- warm: the same request on a `PrefixCache` after an earlier request (prefix + another question) left the
  prefix cached: it resumes at the last Mamba snapshot inside the prefix (every `--snapshot-interval`
  prompt tokens) and computes the rest;
- the greedy first token of both (must be equal) and what the cache holds for the prefix: one Mamba state
  per snapshot (constant) and the prefix's keys and values in the KV pool (linear in the prefix).
With `--config` the model is built with random weights (`hybrid.training.init_weights`) in `--dtype`.
Prints a table and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hybrid.atomic import atomic_write_text
from hybrid.cli import DEFAULT_CHECKPOINT
from hybrid.config import HybridConfig
from hybrid.dtypes import torch_dtype
from hybrid.generate import generate_ids
from hybrid.loading import build_model, load
from hybrid.prefix_cache import PrefixCache
from hybrid.training import init_weights



def write_json(path: Path, content, indent: int = 1) -> None:
    """Write `content` as JSON to `path` atomically (`hybrid.atomic`: a failed write leaves the previous file)."""
    atomic_write_text(path, json.dumps(content, indent=indent, default=str) + "\n")


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The options naming the model a bench runs: a checkpoint, or a config built with random weights."""
    p.add_argument("checkpoint", nargs="?", default=None, help="checkpoint directory (default: the shipped one)")
    p.add_argument("--config", default=None, help="config.json to build with random weights instead")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None)


def build(args):
    """(model, its name) from `model_arguments`' options; sets the torch threads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.config:
        config = HybridConfig.from_file(args.config)
        model = build_model(config, torch.float32, device="cpu")
        init_weights(model, seed=0)
        return model.cast(torch_dtype(args.dtype)).eval(), Path(args.config).name
    model, _ = load(args.checkpoint or DEFAULT_CHECKPOINT, dtype=args.dtype)
    return model.eval(), str(args.checkpoint or DEFAULT_CHECKPOINT.name)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--snapshot-interval", type=int, default=256,
                   help="prompt tokens between Mamba snapshots (a multiple of the KV block size 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("prefix_cache_bench.json"))
    args = p.parse_args(argv)

    model, name = build(args)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, V, (args.prefix_tokens,), generator=g).tolist()
    questions = [torch.randint(3, V, (args.question_tokens,), generator=g).tolist() for _ in range(args.repeats + 1)]

    def cold(prompt):
        (c,) = generate_ids(model, [prompt], max_new_tokens=1)
        return c.prefill_seconds, c.token_ids[0]

    prefix_cache = PrefixCache(model, snapshot_interval=args.snapshot_interval, max_bytes=1 << 40)
    start = time.perf_counter()
    prefix_cache.generate([prefix + questions[0]], 1)  # the earlier request that leaves the prefix cached
    first_request = time.perf_counter() - start

    cold_s, warm_s, reused, same = [], [], [], True
    for q in questions[1:]:
        seconds, token_cold = cold(prefix + q)
        cold_s.append(seconds)
        (c,) = prefix_cache.generate([prefix + q], 1)
        warm_s.append(c.prefill_seconds)  # from the request's arrival to its first token (restore included)
        reused.append(c.cached_tokens)
        same &= c.token_ids[0] == token_cold

    config = model.config
    mamba_bytes = model.new_cache(1).state_nbytes()  # one sequence's Mamba state: what one snapshot holds
    kv_per_token = (2 * config.hybrid_override_pattern.count("*") * config.num_key_value_heads * config.head_dim
                    * model.dtype.itemsize)  # keys and values of every attention layer, in the pool's dtype
    snapshots = args.prefix_tokens // args.snapshot_interval
    result = {
        "model": name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prefix_tokens": args.prefix_tokens, "question_tokens": args.question_tokens,
        "snapshot_interval": args.snapshot_interval,
        "reused_tokens": min(reused),
        "ttft_cold_s": statistics.median(cold_s), "ttft_warm_s": statistics.median(warm_s),
        "speedup": statistics.median(cold_s) / statistics.median(warm_s),
        "first_request_with_snapshots_s": first_request,
        "same_first_token": same,
        "snapshot_mamba_bytes": mamba_bytes,
        "kv_bytes_per_token": kv_per_token,
        "cache_bytes_for_prefix": snapshots * mamba_bytes + args.prefix_tokens * kv_per_token,
        "cache_bytes_held": prefix_cache.nbytes,
    }
    write_json(args.out, result)
    print(f"{name} ({args.dtype}, {result['threads']} threads): {args.prefix_tokens}-token shared prefix + "
          f"{args.question_tokens}-token question")
    print(f"  time to first token: cold {result['ttft_cold_s']:.3f} s, with the prefix cached "
          f"{result['ttft_warm_s']:.3f} s ({result['speedup']:.1f}x); same first token: {same}")
    print(f"  reused {result['reused_tokens']} prompt tokens; cache: {mamba_bytes:,} B Mamba state per snapshot "
          f"+ {kv_per_token:,} B KV per token = {result['cache_bytes_for_prefix']:,} B for the prefix ({snapshots} "
          f"snapshots every {args.snapshot_interval} tokens); held in all: {result['cache_bytes_held']:,} B")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
