"""Recall study: hybrid Mamba-2 + attention vs pure Mamba-2 vs pure (NoPE) attention on MQAR.

    python scripts/recall_study.py --pairs 4 8 16 32 64 --state-sizes 4 16 64 --steps 1000 --jobs 2 \
        --out docs/recall_study

The task is multi-query associative recall (MQAR) from Zoology (Arora et al. 2023, "Zoology: Measuring and
Improving Recall in Efficient Language Models", arXiv:2312.04927; generator `multiquery_ar` in
HazyResearch/zoology). A sequence holds `pairs` key-value token pairs, then every key is queried once at a
random position of the rest of the sequence, the value written right after it:

    k1 v1 k2 v2 ... kP vP | x x k3 v3 x x x x k1 v1 k2 v2 x ...        (x: random filler tokens)
                               ^-- predict v3            ^-- predict v1

Loss and accuracy count only the answer positions (the query keys, whose next token is the value). Keys
come from the lower half of the vocabulary, values from the upper half; query slots are drawn with
Zoology's power law (early slots more likely). A fixed-size recurrent state has to compress all pairs, so
pure Mamba-2 fails once `pairs` exceeds what its state holds, while one attention layer (after a Mamba-2
layer that tells each token what came before it) looks the answer up exactly. NoPE attention alone has no
notion of position, so it cannot tell which value follows which key.

Protocol (Zoology's): each model is trained once on a mixture of the pair counts (every step draws one
count and a fresh batch of it) at one sequence length, then scored on a held-out test set of each count;
the easy counts teach the lookup, the large ones measure capacity. `--per-pair-runs` trains a separate
model per count instead (much slower to learn: a model trained on 16 pairs alone may sit on a plateau
for thousands of steps).

Every model is our own `hybrid.model.HybridForCausalLM` (built with `hybrid.loading.build_model`,
initialised with `hybrid.training.init_weights`) with a two-layer pattern and no MLP: `M*` (hybrid),
`MM` (pure Mamba-2), `**` (pure attention). Sizes are picked so the three have about the same parameter
count: the Mamba-2 mixer has d_inner = 2 * d_model (heads of 16), the attention layer has
num_heads * head_dim = 2 * d_model, so each mixer holds about 8 * d_model^2 weights (the Mamba-2 one a
little less or more depending on the state size). All runs see the same training examples (the stream
depends only on the seed) and the same test sets, and train with AdamW (weight decay 0.1 on matrices),
linear warm-up then cosine decay, gradient clipping at 1. Weights start from `init_weights` with
initializer_range = 1/sqrt(d_model) (see `model_config`).

Outputs in --out: `results.jsonl` (one record per run and evaluated pair count), `results.csv` (the same
records), `accuracy.png` (accuracy vs pairs, one line per architecture, one panel per state size); the
table is printed. Pure attention does not depend on the state size: it is trained once (state_size
empty) and drawn in every panel. Each file is written atomically (`hybrid.atomic`), results.jsonl after
every run, so an interruption leaves the results so far, never a partial file.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid.atomic import atomic_path, atomic_write_text
from hybrid.config import MAMBA, HybridConfig
from hybrid.loading import build_model
from hybrid.model import HybridForCausalLM
from hybrid.training import init_weights, learning_rate

ARCHS = {"hybrid": "M*", "mamba2": "MM", "attention": "**"}
IGNORE = -100  # target of the positions that are not scored (F.cross_entropy's ignore_index)
FIELDS = ["arch", "pattern", "pairs", "state_size", "seq_len", "d_model", "vocab_size", "params", "train_pairs",
          "steps", "batch_size", "lr", "seconds", "final_loss", "accuracy", "seed"]


# ---------------------------------------------------------------------------------------------- data
def mqar_batch(num_examples: int, pairs: int, seq_len: int, vocab_size: int, generator: torch.Generator,
               power_a: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of MQAR sequences (after Zoology's `multiquery_ar`).

    Layout of each row: positions [0, 2P) hold k1 v1 ... kP vP (P = `pairs` distinct keys from
    [1, V/2), P distinct values from [V/2, V)); the rest is cut into two-token slots, and each key is
    queried once in its own slot as `key value`, slot j drawn with probability proportional to
    (j + 1) ** (power_a - 1); every other position holds a uniformly random token. (Zoology leaves the
    token after a query random; writing the value there keeps each row a well-formed sequence, and only
    the query position is scored either way, so nothing leaks.)

    Returns:
        inputs [B, T] int64 and targets [B, T] int64: the value at each query key's position (the token
        the model must predict next), IGNORE elsewhere; exactly P scored positions per row.
    Raises:
        ValueError: seq_len < 4 * pairs (no room for the queries) or too small a vocabulary.
    """
    B, P, T, V = num_examples, pairs, seq_len, vocab_size
    half = V // 2
    if T < 4 * P:
        raise ValueError(f"seq_len {T} is too short for {P} pairs: MQAR needs seq_len >= 4 * pairs")
    if P > half - 1:
        raise ValueError(f"vocab_size {V} is too small for {P} distinct keys and values")
    keys = torch.rand(B, half - 1, generator=generator).argsort(dim=1)[:, :P] + 1  # [B, P] in [1, V/2)
    values = torch.rand(B, V - half, generator=generator).argsort(dim=1)[:, :P] + half  # [B, P] in [V/2, V)
    slots = (T - 2 * P) // 2
    weight = power_a * torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    slot = torch.multinomial(weight.expand(B, slots), P, replacement=False, generator=generator)  # [B, P]
    query_pos = 2 * P + 2 * slot  # [B, P]: where key i is queried

    inputs = torch.randint(0, V, (B, T), generator=generator)
    inputs[:, 0 : 2 * P : 2] = keys
    inputs[:, 1 : 2 * P : 2] = values
    inputs.scatter_(1, query_pos, keys)
    inputs.scatter_(1, query_pos + 1, values)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    targets.scatter_(1, query_pos, values)
    return inputs, targets


# ---------------------------------------------------------------------------------------------- models
def model_config(pattern: str, d_model: int, state_size: int, vocab_size: int, seq_len: int) -> HybridConfig:
    """A two-or-more-layer config of Mamba-2 (`M`) and NoPE attention (`*`) layers of about equal size.

    Mamba-2: d_inner = 2 * d_model in heads of 16, n_groups 1, conv kernel 4, chunk 64 (or seq_len).
    Attention: 4 heads of d_model / 2 (multi-head, no GQA), so q, k, v, o are [2 * d_model, d_model].
    """
    return HybridConfig(
        hybrid_override_pattern=pattern, vocab_size=vocab_size, hidden_size=d_model, tie_word_embeddings=False,
        num_attention_heads=4, num_key_value_heads=4, head_dim=d_model // 2,
        mamba_num_heads=2 * d_model // 16, mamba_head_dim=16, ssm_state_size=state_size, n_groups=1,
        conv_kernel=4, chunk_size=min(64, seq_len), num_nextn_predict_layers=0,
        max_position_embeddings=seq_len, torch_dtype="float32",
        # fan-in init: with the library default 0.02 at d_model 64 the q/k weights start so small that
        # attention learns MQAR many times slower (measured: P=8, T=32, 600 steps: 0.04 accuracy with
        # 0.02, 0.15 with 1/sqrt(64); 1500 steps with 1/sqrt(64): 1.00)
        initializer_range=d_model ** -0.5,
    )


def build(pattern: str, d_model: int, state_size: int, vocab_size: int, seq_len: int, seed: int) -> HybridForCausalLM:
    """Our model for `pattern`, in fp32 on the CPU, initialised from `seed`."""
    config = model_config(pattern, d_model, state_size, vocab_size, seq_len)
    config.validate()
    model = build_model(config, torch.float32, "cpu")
    init_weights(model, seed)
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- training
@dataclass
class RunSpec:
    """One training run: one model, trained on `train_pairs`, scored at each of `eval_pairs`.

    `state_size` is None for patterns without Mamba-2 layers.
    """

    arch: str
    pattern: str
    train_pairs: tuple[int, ...]
    eval_pairs: tuple[int, ...]
    state_size: int | None
    seq_len: int
    d_model: int
    vocab_size: int
    steps: int | None
    time_budget: float | None  # seconds; the schedule then runs over wall-clock time
    batch_size: int
    lr: float
    weight_decay: float
    warmup: float
    eval_examples: int
    seed: int
    threads: int
    log_every: int = 0


def answer_loss(model: HybridForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at the answer positions only. inputs, targets: [B, T] -> scalar."""
    logits = model(inputs)  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def accuracy(model: HybridForCausalLM, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 250) -> float:
    """Fraction of answer positions whose argmax over the whole vocabulary is the value. [N, T] each."""
    model.eval()
    hits = total = 0
    for start in range(0, inputs.shape[0], batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        scored = y != IGNORE
        hits += (model(x).argmax(-1)[scored] == y[scored]).sum().item()
        total += scored.sum().item()
    return hits / total


def optimizer(model: HybridForCausalLM, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and the conv filters) only, not on norms, biases, A, D, dt."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def test_set(spec: RunSpec, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out examples for one pair count: [eval_examples, seq_len] inputs and targets, drawn from a
    generator of their own (never the training stream), the same for every architecture."""
    generator = torch.Generator().manual_seed(spec.seed + 1_000_003 * pairs)
    return mqar_batch(spec.eval_examples, pairs, spec.seq_len, spec.vocab_size, generator)


def train_run(spec: RunSpec) -> list[dict]:
    """Train one model from scratch on fresh MQAR batches, then score it at each of `spec.eval_pairs`.

    Each step draws one pair count from `spec.train_pairs` and a fresh batch of it; the stream depends only
    on `spec.seed`, so every architecture sees the same examples. Returns one record per evaluated pair
    count (keys: FIELDS).
    """
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model = build(spec.pattern, spec.d_model, spec.state_size or 1, spec.vocab_size, spec.seq_len, spec.seed)
    opt = optimizer(model, spec.lr, spec.weight_decay)
    train_gen = torch.Generator().manual_seed(spec.seed)

    step, start, loss = 0, time.time(), float("nan")
    while True:
        elapsed = time.time() - start
        progress = step / spec.steps if spec.steps else elapsed / spec.time_budget
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate(progress, spec.lr, spec.warmup)
        model.train()
        pairs = spec.train_pairs[torch.randint(len(spec.train_pairs), (), generator=train_gen).item()]
        inputs, targets = mqar_batch(spec.batch_size, pairs, spec.seq_len, spec.vocab_size, train_gen)
        loss_t = answer_loss(model, inputs, targets)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, loss = step + 1, loss_t.item()
        if spec.log_every and step % spec.log_every == 0:
            print(f"  {spec.arch} N={spec.state_size} step {step} P={pairs} loss {loss:.3f} "
                  f"({time.time() - start:.0f}s)", file=sys.stderr, flush=True)
    seconds = time.time() - start
    common = {"arch": spec.arch, "pattern": spec.pattern, "state_size": spec.state_size, "seq_len": spec.seq_len,
              "d_model": spec.d_model, "vocab_size": spec.vocab_size, "params": count_params(model),
              "train_pairs": " ".join(map(str, spec.train_pairs)), "steps": step, "batch_size": spec.batch_size,
              "lr": spec.lr, "seconds": round(seconds, 1), "final_loss": round(loss, 4), "seed": spec.seed}
    scores = {pairs: round(accuracy(model, *test_set(spec, pairs)), 4) for pairs in spec.eval_pairs}
    return [{k: {**common, "pairs": pairs, "accuracy": acc}[k] for k in FIELDS} for pairs, acc in scores.items()]


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The grid of runs: architecture x state size, each trained on the mixture of all pair counts and
    scored at each (Zoology's protocol); with --per-pair-runs, one run per pair count instead.
    Attention-only patterns have no state: one run covers every state size."""
    groups = [(p,) for p in args.pairs] if args.per_pair_runs else [tuple(args.pairs)]
    specs = []
    for pairs in groups:
        for i, state_size in enumerate(args.state_sizes):
            for arch in args.archs:
                pattern = ARCHS.get(arch, arch)
                if MAMBA not in pattern and i > 0:
                    continue
                specs.append(RunSpec(
                    arch=arch, pattern=pattern, train_pairs=pairs, eval_pairs=pairs,
                    state_size=state_size if MAMBA in pattern else None,
                    seq_len=args.seq_len or max(64, 4 * max(args.pairs)), d_model=args.d_model,
                    vocab_size=args.vocab_size, steps=args.steps, time_budget=args.time_budget,
                    batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay, warmup=args.warmup,
                    eval_examples=args.eval_examples, seed=args.seed, threads=args.threads,
                    log_every=args.log_every))
    return specs


# ---------------------------------------------------------------------------------------------- reports
def write_jsonl(records: list[dict], path: Path) -> None:
    """All records, one JSON object a line, written atomically (a failed write leaves the previous file)."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def write_csv(records: list[dict], path: Path) -> None:
    """The same records as the JSONL, one row each (an empty cell for a missing state size), atomically."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows({k: ("" if r[k] is None else r[k]) for k in FIELDS} for r in records)
    atomic_write_text(path, buffer.getvalue())


def write_plot(records: list[dict], path: Path) -> None:
    """Accuracy vs key-value pairs: one panel per state size, one line per architecture (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    states = sorted({r["state_size"] for r in records if r["state_size"] is not None}) or [None]
    archs = list(dict.fromkeys(r["arch"] for r in records))
    fig, axes = plt.subplots(1, len(states), figsize=(4.2 * len(states), 3.6), sharey=True, squeeze=False)
    for ax, state in zip(axes[0], states):
        for arch in archs:
            rows = sorted((r for r in records if r["arch"] == arch and r["state_size"] in (state, None)),
                          key=lambda r: r["pairs"])
            if rows:
                ax.plot([r["pairs"] for r in rows], [r["accuracy"] for r in rows], marker="o",
                        label=f"{arch} ({rows[0]['pattern']})", linestyle="--" if rows[0]["state_size"] is None else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["pairs"] for r in records}), labels=[str(p) for p in sorted({r["pairs"] for r in records})])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("key-value pairs")
        ax.set_title(f"SSM state size {state}" if state is not None else "")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(loc="lower left", fontsize=8)
    r0 = records[0]
    fig.suptitle(f"MQAR recall, d_model {r0['d_model']}, seq_len {r0['seq_len']}, {r0['steps']} steps", fontsize=10)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120)
    finally:
        plt.close(fig)


def format_table(records: list[dict]) -> str:
    """Rows: architecture x state size (with the parameter count); columns: accuracy per pair count."""
    pairs = sorted({r["pairs"] for r in records})
    archs = list(dict.fromkeys(r["arch"] for r in records))
    rows = {}
    for r in sorted(records, key=lambda r: (archs.index(r["arch"]), r["state_size"] or 0, r["pairs"])):
        rows.setdefault((r["arch"], r["pattern"], r["state_size"], r["params"]), {})[r["pairs"]] = r["accuracy"]
    head = f"{'arch':<10} {'pattern':<7} {'state':>5} {'params':>8} | " + " ".join(f"P={p:<4}" for p in pairs)
    lines = [head, "-" * len(head)]
    for (arch, pattern, state, params), accs in rows.items():
        cells = " ".join(f"{accs[p]:<6.2f}" if p in accs else f"{'':<6}" for p in pairs)
        lines.append(f"{arch:<10} {pattern:<7} {'-' if state is None else state:>5} {params:>8,} | {cells}")
    return "\n".join(lines)


def write_reports(records: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(records, out / "results.jsonl")
    write_csv(records, out / "results.csv")
    write_plot(records, out / "accuracy.png")


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="numbers of key-value pairs")
    p.add_argument("--per-pair-runs", action="store_true",
                   help="train a separate model per pair count (default: one model on the mixture, scored at each)")
    p.add_argument("--state-sizes", type=int, nargs="+", default=[4, 16, 64], help="Mamba-2 ssm_state_size values")
    p.add_argument("--archs", nargs="+", default=list(ARCHS),
                   help=f"names ({', '.join(f'{k}={v}' for k, v in ARCHS.items())}) or layer patterns of M and *")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=None, help="default: max(64, 4 * largest pair count)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=None, help="optimiser steps per run (default 1000)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of training per run instead of --steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the run spent warming up")
    p.add_argument("--eval-examples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: all cores / jobs)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes")
    p.add_argument("--log-every", type=int, default=0, help="print the training loss every N steps (0: never)")
    p.add_argument("--out", type=Path, default=Path("docs/recall_study"))
    args = p.parse_args(argv)
    if args.steps is not None and args.time_budget is not None:
        p.error("give at most one of --steps and --time-budget")
    if args.steps is None and args.time_budget is None:
        args.steps = 1000
    for arch in args.archs:
        if not set(ARCHS.get(arch, arch)) <= {"M", "*"}:
            p.error(f"--archs: {arch!r} is neither {sorted(ARCHS)} nor a pattern of M and *")
    if args.threads is None:
        args.threads = max(1, torch.get_num_threads() // args.jobs)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = run_specs(args)
    print(f"{len(specs)} runs, {args.jobs} at a time with {args.threads} thread(s) each", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) if args.jobs > 1 else _Serial() as pool:
        for run_records in pool.map(train_run, specs):
            for record in run_records:
                print(json.dumps(record), file=sys.stderr, flush=True)
            records.extend(run_records)
            write_jsonl(records, args.out / "results.jsonl")  # partial results survive an interruption
    write_reports(records, args.out)
    print(format_table(records))
    return 0


class _Serial:
    """`ProcessPoolExecutor`'s `map` in this process (for --jobs 1)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items):
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())
