"""Measure bf16 against its FP8, NVFP4 and MXFP4 copies: resident memory, logit agreement, passkey accuracy,
CPU prefill and decode speed. Writes one JSON object (and prints a Markdown table).

    python scripts/quantize_report.py --checkpoint checkpoints/hybrid-mini --random-config large \\
        --out results/quantize_report.json --threads 8

For each source model (a checkpoint directory, and/or a random model of a larger config) and each format:
the copy is made with `hybrid.quantize.quantize_model` (default exclusions, calibration on the built-in
text), written with `save_checkpoint` and loaded back with `hybrid.load_model`, so the numbers are those of
the real loading path. Measured, in one process and one run (speeds are relative to bf16 in that run):

- resident_bytes: distinct tensor storage the loaded model holds (weights, scales, buffers)
- kl, top1: mean KL(bf16 || copy) of the next-token distributions and the share of positions whose argmax
  agrees, over a fixed text (the calibration text is not reused for this)
- passkey: share of passkey prompts (hybrid.eval.tasks, `--passkey-samples` at `--passkey-tokens` tokens,
  depths spread over the context) whose greedy answer contains the key (only with a tokenizer)
- prefill_tok_s, decode_tok_s and their ratios to bf16: `hybrid.generate.generate_ids`, greedy, batch 1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hybrid  # noqa: E402
from hybrid.accounting import resident_bytes  # noqa: E402
from hybrid.atomic import atomic_write_text  # noqa: E402
from hybrid.calibration import calibration_batches  # noqa: E402
from hybrid.config import HybridConfig  # noqa: E402
from hybrid.generate import generate_ids  # noqa: E402
from hybrid.loading import build_model  # noqa: E402
from hybrid.quantize import quantize_model  # noqa: E402
from hybrid.saving import save_checkpoint  # noqa: E402

FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
EVAL_TEXT = (
    "The committee met on a cold morning in February to review the proposal for the new library. After a long "
    "discussion about the budget, the architect presented three designs: a glass pavilion by the river, a brick "
    "building next to the old school, and a small wooden hall in the park. Most members preferred the second "
    "design because it was cheaper to heat and closer to the bus station. The final vote was seven to two. "
    "In other news, the football club announced that its stadium will be renovated over the summer, and the "
    "local bakery won a regional prize for its rye bread. Tomorrow the weather will be dry with light winds."
)
# A larger random config: wide enough that the routed experts dominate memory, as in the real models.
RANDOM_CONFIGS = {
    "large": dict(hybrid_override_pattern="MEM*EMEM*E", vocab_size=32000, hidden_size=1024, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64, n_groups=4,
                  ssm_state_size=64, chunk_size=64, n_routed_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, torch_dtype="bfloat16"),
    "tiny": dict(hybrid_override_pattern="ME*E", vocab_size=512, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                 ssm_state_size=16, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, torch_dtype="bfloat16"),
}


def random_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """A random bf16 model of config `name`, initialised at a trained-like scale (std 0.02 linears)."""
    config = HybridConfig(**RANDOM_CONFIGS[name])
    config.validate()
    model = build_model(config, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif pname.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 4)
            elif pname.endswith(("norm.weight", "norm_f.weight")):
                p.fill_(1.0)
            elif pname.endswith(".D"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_checkpoint(model.cast(torch.bfloat16), directory)
    return directory


def eval_ids(tokenizer, vocab: int, n: int = 256) -> torch.Tensor:
    if tokenizer is not None:
        ids = tokenizer.encode(EVAL_TEXT)
        while len(ids) < n:
            ids = ids + ids
        return torch.tensor([ids[:n]])
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(123))


@torch.no_grad()
def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    p, q = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def passkey_accuracy(model, tokenizer, samples: int, tokens: int) -> float | None:
    if tokenizer is None or samples == 0:
        return None
    from hybrid.eval.tasks import fit_to_length

    right = 0
    for i in range(samples):
        depth = 100.0 * i / max(samples - 1, 1)
        s = fit_to_length("passkey", tokenizer, tokens, seed=i, depth_percent=depth)
        (c,) = generate_ids(model, [tokenizer.encode(s.prompt)], max_new_tokens=8, stop_ids=tokenizer.stop_ids)
        text = tokenizer.decode(c.token_ids)
        right += any(a in text for a in s.answers)
    return right / samples


def speed(model, vocab: int, prompt_tokens: int, decode_tokens: int, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` prefill and decode tokens/s (greedy, batch 1, no stop)."""
    ids = torch.randint(3, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    best_p = best_d = 0.0
    for _ in range(repeats):
        (c,) = generate_ids(model, [ids], max_new_tokens=decode_tokens)
        best_p = max(best_p, c.prefill_tokens_per_s)
        best_d = max(best_d, c.decode_tokens_per_s or 0.0)
    return best_p, best_d


def measure(source: Path, label: str, args, workdir: Path) -> dict:
    has_tok = (source / "tokenizer.json").exists()
    tokenizer = hybrid.load(source, dtype="bf16")[1] if has_tok else None
    results, ref_logits = {}, None
    for fmt in FORMATS:
        t0 = time.perf_counter()
        if fmt == "bf16":
            path = source
        else:
            model = hybrid.load_model(source, dtype="bf16")
            calib = (calibration_batches(tokenizer, args.calibration_samples, 128) if tokenizer is not None else
                     [torch.randint(3, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(i))
                      for i in range(args.calibration_samples)])
            quantize_model(model, fmt, calibration=None if fmt == "mxfp4" else calib)
            path = save_checkpoint(model, workdir / f"{label}-{fmt}")
            del model
        model = hybrid.load_model(path, dtype="bf16")
        quantize_s = time.perf_counter() - t0
        vocab = model.config.vocab_size
        ids = eval_ids(tokenizer, vocab, args.eval_tokens)
        with torch.no_grad():
            logits = model(ids)
        row = {"resident_bytes": resident_bytes(model), "prepare_seconds": round(quantize_s, 2)}
        if ref_logits is None:
            ref_logits = logits
        kl, top1 = agreement(ref_logits, logits)
        row.update(kl=kl, top1=top1)
        row["passkey"] = passkey_accuracy(model, tokenizer, args.passkey_samples, args.passkey_tokens)
        row["prefill_tok_s"], row["decode_tok_s"] = speed(model, vocab, args.prompt_tokens, args.decode_tokens,
                                                          args.repeats)
        results[fmt] = row
        del model
        print(f"  {label} {fmt}: {json.dumps(row)}", file=sys.stderr)
    base = results["bf16"]
    for row in results.values():
        row["memory_vs_bf16"] = row["resident_bytes"] / base["resident_bytes"]
        row["prefill_vs_bf16"] = row["prefill_tok_s"] / base["prefill_tok_s"] if base["prefill_tok_s"] else math.nan
        row["decode_vs_bf16"] = row["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else math.nan
    return {"source": str(source), "formats": results}


def markdown(report: dict) -> str:
    lines = []
    for label, entry in report["models"].items():
        lines.append(f"\n**{label}** (`{entry['source']}`)\n")
        lines.append("| copy | resident MiB | vs bf16 | KL vs bf16 | top-1 agree | passkey | prefill vs bf16 | decode vs bf16 |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for fmt, r in entry["formats"].items():
            pk = "-" if r["passkey"] is None else f"{100 * r['passkey']:.0f}%"
            lines.append(f"| {fmt} | {r['resident_bytes'] / 2**20:.1f} | {r['memory_vs_bf16']:.2f} | {r['kl']:.2e} | "
                         f"{100 * r['top1']:.1f}% | {pk} | {r['prefill_vs_bf16']:.2f} | {r['decode_vs_bf16']:.2f} |")
    return "\n".join(lines)


def write_json(path: Path, content, indent: int = 1) -> None:
    """Write `content` as JSON to `path` atomically (`hybrid.atomic`: a failed write leaves the previous file)."""
    atomic_write_text(path, json.dumps(content, indent=indent, default=str) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default checkpoint: checkpoints/hybrid-mini)")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None,
                   help="also measure a random model of this config")
    p.add_argument("--out", default=None, help="JSON output file (default: stdout only)")
    p.add_argument("--eval-tokens", type=int, default=256)
    p.add_argument("--passkey-samples", type=int, default=5)
    p.add_argument("--passkey-tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--calibration-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint is None and args.random_config is None:
        args.checkpoint = str(ROOT / "checkpoints" / "hybrid-mini")
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.checkpoint:
            report["models"]["checkpoint"] = measure(Path(args.checkpoint), "checkpoint", args, work)
        if args.random_config:
            src = random_checkpoint(args.random_config, work / f"random-{args.random_config}")
            report["models"][f"random-{args.random_config}"] = measure(src, f"random-{args.random_config}", args, work)
    text = json.dumps(report, indent=2)
    if args.out:
        write_json(Path(args.out), report, indent=2)
    print(text)
    print(markdown(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
