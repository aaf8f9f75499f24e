"""One rank of the tensor-parallel tests (tests/test_parallel.py starts N of these with the torch.distributed
environment set: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).

    python tests/tp_worker.py CHECKPOINT OUT_DIR --prompt 3,7,11 --new-tokens 24 [--dtype fp32]

Each rank loads its shard (`hybrid.load(..., tensor_parallel=N)`), then computes what the test compares with
one process: the prompt's full logits without a cache; a prefill on a cache then greedy decode steps (tokens and
each step's logits); and the traffic of one decode step. Rank r writes OUT_DIR/rank{r}.json (its expert bank
size, bytes read and held, its cache's sizes, traffic) and OUT_DIR/rank{r}.safetensors (the logits). An error is written to
OUT_DIR/rank{r}.error and the exit status is 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--prompt", required=True)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--mode", choices=["steps", "features"], default="steps",
                   help="steps: logits, greedy steps, traffic (the default); features: `generate_features`")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    try:
        run(args, rank, world, out)
    except Exception as e:
        (out / f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 3
    finally:
        dist.destroy_process_group()
    return 0


@torch.no_grad()
def generate_features(model, prompt: list[int], new_tokens: int, prefix_file: Path) -> dict:
    """Tokens of the generation features on `model` (one process, or one rank): sampling with a seed, MTP
    speculative decoding (greedy and sampled), and a prefix cache (a prompt, then a longer one resuming from
    it, then the longer one again from a fresh cache loaded from the saved file). test_parallel.py compares
    every rank's with one process's."""
    from hybrid.generate import generate_ids
    from hybrid.prefix_cache import PrefixCache
    from hybrid.sampling import SamplingParams

    sampled = SamplingParams(temperature=0.9, top_k=50, seed=11)
    out = {"sampled": generate_ids(model, [prompt], new_tokens, sampled)[0].token_ids}
    if model.mtp is not None:
        for name, sampling in (("speculative_greedy", None), ("speculative_sampled", sampled)):
            c = generate_ids(model, [prompt], new_tokens, sampling, speculative=2)[0]
            out[name] = c.token_ids
            out[name + "_acceptance"] = c.acceptance_rate
    longer = prompt + [5, 6, 7, 8, 9, 10, 11, 12]
    cache = PrefixCache(model, snapshot_interval=16)
    out["prefix_first"] = generate_ids(model, [prompt], 6, prefix_cache=cache)[0].token_ids
    out["prefix_second"] = generate_ids(model, [longer], 6, prefix_cache=cache)[0].token_ids
    out["prefix_reused"] = cache.reused_tokens
    cache.save(prefix_file)
    again = PrefixCache(model, snapshot_interval=16)
    again.load(prefix_file)
    out["prefix_loaded"] = generate_ids(model, [longer], 6, prefix_cache=again)[0].token_ids
    out["prefix_loaded_reused"] = again.reused_tokens
    if model.mtp is not None:  # speculative decoding on a prefix cache: the longer prompt resumes, then drafts
        drafting = PrefixCache(model, snapshot_interval=16, num_speculative_tokens=2)
        generate_ids(model, [prompt], 6, prefix_cache=drafting, speculative=2)
        out["prefix_speculative"] = generate_ids(model, [longer], 6, prefix_cache=drafting, speculative=2)[0].token_ids
    return out


@torch.no_grad()
def run(args, rank: int, world: int, out: Path) -> None:
    import hybrid
    from safetensors.torch import save_file

    model = hybrid.load_model(args.checkpoint, dtype=args.dtype, tensor_parallel=world, progress=False)
    if args.mode == "features":
        prompt = [int(t) for t in args.prompt.split(",")]
        features = generate_features(model, prompt, args.new_tokens, out / f"prefix.rank{rank}.safetensors")
        (out / f"rank{rank}.json").write_text(json.dumps(features))
        return
    ids = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    full = model(ids)
    cache = model.new_cache(1)
    logits = model(ids, cache=cache, logits_to_keep=1)
    steps, tokens = [], []
    comm = model.parallel.comm
    traffic = None
    for i in range(args.new_tokens):
        steps.append(logits[:, -1])
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        if i == 1:
            comm.reset()
        logits = model(token, cache=cache)
        if i == 1:
            traffic = {"calls": dict(comm.traffic.calls), "payload": dict(comm.traffic.payload)}
    mixers = [b.mixer for b in model.backbone.layers]
    banks = [m.experts.n_experts for m in mixers if hasattr(m, "experts")]
    offsets = [m.expert_offset for m in mixers if hasattr(m, "experts")]
    held = {t.data_ptr(): t for t in model.state_dict().values()}  # a tied head once
    (out / f"rank{rank}.json").write_text(json.dumps({
        "tokens": tokens, "read_bytes": model.parallel.read_bytes, "traffic": traffic,
        "kv_bytes_per_token": cache.kv_nbytes() // cache.seq_len, "mamba_state_bytes": cache.state_nbytes(),
        "experts": banks, "expert_offsets": offsets,
        "state_bytes": sum(t.numel() * t.element_size() for t in held.values()),
    }))
    save_file({"full": full.contiguous(), "steps": torch.cat(steps).contiguous()}, str(out / f"rank{rank}.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
