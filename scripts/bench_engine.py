"""Continuous batching: N concurrent requests on the serving engine against the same requests one by one.

    python scripts/bench_engine.py                                           # the shipped checkpoint
    python scripts/bench_engine.py --config checkpoints/configs/bench-medium.config.json --requests 8

N requests of random prompts (`--prompt-tokens`, lengths spread from half to all of it) each generate
`--new-tokens` greedy tokens. Measured in one run, same model and threads:
- one by one: `hybrid.generate.generate_ids` on each request alone (what a server without batching does);
- engine: all N added at once to `hybrid.serving.engine.Engine` (prompt chunks and decode tokens packed
  into each forward, paged KV, state slots);
and whether each request's tokens are the same (in fp32 they must be; in bf16 the batched products round
differently from the solo ones, so on random weights, whose logits are nearly flat, greedy paths may part:
the common prefix is reported). Prints generated tokens per second of each and their ratio, the
engine's forwards and peak sequences per forward; writes JSON to `--out`. With `--config` the model is built
with random weights in `--dtype`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench_prefix_cache import build, model_arguments  # scripts/ is on the path of a script run from it
from hybrid.atomic import atomic_write_text
from hybrid.generate import generate_ids
from hybrid.serving.engine import Engine


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("engine_bench.json"))
    args = p.parse_args(argv)
    model, name = build(args)
    g = torch.Generator().manual_seed(0)
    lo = max(1, args.prompt_tokens // 2)
    prompts = [torch.randint(3, model.config.vocab_size, (int(torch.randint(lo, args.prompt_tokens + 1, (1,),
                                                                                 generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    generated = args.requests * args.new_tokens

    start = time.perf_counter()
    solo = [generate_ids(model, [q], max_new_tokens=args.new_tokens)[0].token_ids for q in prompts]
    solo_s = time.perf_counter() - start

    tokens_needed = sum(len(q) for q in prompts) + generated
    engine = Engine(model, num_blocks=tokens_needed // 16 + 2 * args.requests, max_num_seqs=args.requests,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    forwards, widest = 0, 0
    start = time.perf_counter()
    ids = [engine.add_request(q, None, args.new_tokens) for q in prompts]
    while engine.has_unfinished():
        engine.step()
        forwards += 1
        widest = max(widest, engine.last_step.num_seqs)
    engine_s = time.perf_counter() - start
    outputs = [engine.requests[i].output_ids for i in ids]
    same = sum(o == s for o, s in zip(outputs, solo))
    common = [next((k for k, (a, b) in enumerate(zip(o, s)) if a != b), len(s)) for o, s in zip(outputs, solo)]

    result = {
        "model": name, "dtype": args.dtype, "threads": torch.get_num_threads(), "requests": args.requests,
        "prompt_tokens": [len(q) for q in prompts], "new_tokens": args.new_tokens,
        "one_by_one_s": solo_s, "engine_s": engine_s,
        "one_by_one_tokens_per_s": generated / solo_s, "engine_tokens_per_s": generated / engine_s,
        "speedup": solo_s / engine_s, "forwards": forwards, "widest_forward_seqs": widest, "requests_with_the_same_tokens": same,
        "common_prefix_tokens": common,
        "kv_pool_bytes": engine.blocks.nbytes(), "state_slot_bytes": engine.slots.slot_nbytes(),
    }
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    print(f"{name} ({args.dtype}, {result['threads']} threads): {args.requests} requests, prompts "
          f"{min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens, {args.new_tokens} new tokens each")
    print(f"  one by one: {solo_s:.2f} s ({result['one_by_one_tokens_per_s']:.1f} generated tok/s)")
    print(f"  engine:     {engine_s:.2f} s ({result['engine_tokens_per_s']:.1f} generated tok/s), {forwards} forwards, "
          f"up to {widest} sequences per forward: {result['speedup']:.2f}x")
    print(f"  same tokens as one by one: {same} of {args.requests} requests (common prefix: min {min(common)} of "
          f"{args.new_tokens})")
    return 0 if same == args.requests or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
