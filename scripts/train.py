"""Train a small hybrid Mamba-2 / attention / MoE model from scratch on the CPU and save it as a
published-style checkpoint (the project's default checkpoint is made with this script).

    python scripts/train.py --out checkpoints/hybrid-mini --time-budget 60 --eval-every 300   # the shipped checkpoint

Data, all offline: English prose from the Python documentation that ships with CPython
(`pydoc_data.topics`, plus docstrings of common standard-library modules), mixed with synthetic
long-context recall tasks (`hybrid.eval.tasks`: passkey, needle, phonebook, key-value recall). A byte-level
BPE tokenizer with single-digit pre-tokenisation is trained on the same data with `tokenizers`.

Optimisation: AdamW (betas 0.9 / 0.95, weight decay on matrices), linear warm-up then cosine decay
(over steps, or over the wall-clock budget with --time-budget), gradient clipping, bf16 autocast,
DeepSeek-V3 auxiliary-loss-free expert balancing, an MTP loss when the preset has an MTP block.
Everything random is seeded; with --steps the run is reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from hybrid.checkpoint_writer import check_destination
from hybrid.config import HybridConfig
from hybrid.dtypes import torch_dtype
from hybrid.eval.tasks import fit_to_length
from hybrid.loading import build_model
from hybrid.saving import save_checkpoint
from hybrid.training import ExpertBalancer, init_weights, learning_rate, lm_loss, train_step

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 = pad, bos, eos (the config's ids)

PRESETS = {
    # the shipped default: 10 layers, Mamba-2 and MoE with two NoPE attention layers, one MTP pair
    "hybrid-mini": dict(
        hybrid_override_pattern="MEM*EMEM*E", vocab_size=4096, hidden_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=32, n_groups=2, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512, routed_scaling_factor=1.0,
        num_nextn_predict_layers=1, mtp_pattern="*E", max_position_embeddings=2048,
        initializer_range=256**-0.5,  # fan-in scale: 0.02 is too small at this width for retrieval to be learned
    ),
    # a few-second smoke run (tests)
    "smoke": dict(
        hybrid_override_pattern="ME*E", vocab_size=512, hidden_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, mamba_num_heads=2, mamba_head_dim=32, ssm_state_size=16,
        n_groups=1, chunk_size=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, num_nextn_predict_layers=1, mtp_pattern="*E",
        max_position_embeddings=512, initializer_range=64**-0.5,
    ),
}

TASK_WEIGHTS = {"passkey": 0.3, "needle": 0.25, "phonebook": 0.2, "kv_recall": 0.25}

DOC_MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar codecs collections configparser contextlib copy csv "
    "dataclasses datetime decimal difflib email enum fnmatch fractions functools gettext glob gzip hashlib heapq "
    "hmac html http.client inspect io ipaddress itertools json locale logging math operator os pathlib pprint "
    "queue random re sched secrets shlex shutil socket sqlite3 statistics string struct subprocess tarfile "
    "tempfile textwrap threading time timeit tokenize types typing unicodedata unittest urllib.parse uuid "
    "warnings weakref zipfile"
).split()


# ---------------------------------------------------------------------------------------------- data
def prose_documents() -> list[str]:
    """The Python reference documentation topics plus docstrings (> 200 characters) of `DOC_MODULES`."""
    import inspect

    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        for obj in [module] + [getattr(module, a) for a in sorted(vars(module)) if not a.startswith("_")]:
            if obj is not module and getattr(obj, "__module__", None) != name:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in docs:
                docs.append(doc)
    return docs


def task_text(task: str, seed: int, tokenizer=None, target: int = 200, depth: float = 50.0) -> tuple[str, str]:
    """(prompt, continuation) of one task instance; with no tokenizer, a rough size in characters.

    kv_recall asks 1 to 12 keys, every answer but the last inside the prompt: many retrievals per row
    give the attention layers a dense copying signal (as in Zoology's MQAR).
    """
    if tokenizer is None:  # tokenizer training: a rough length is enough
        tokenizer = _CharCounter()
    options = {"n_queries": 1 + seed % 12} if task == "kv_recall" else {}
    sample = fit_to_length(task, tokenizer, target, seed, depth, **options)
    return sample.prompt, sample.continuation


class _CharCounter:
    def encode(self, text):
        return text[::4]


def train_tokenizer(docs: list[str], vocab_size: int, seed: int) -> Tokenizer:
    """Byte-level BPE; digits pre-split one by one so numbers copy digit by digit; `<s>` prepended."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(seed)
    tasks = [" ".join(task_text(t, rng.randrange(10**9), target=rng.randint(50, 400))) for t in TASK_WEIGHTS for _ in range(200)]
    tok.train_from_iterator(docs + tasks, trainer)
    return tok


class TrainingData:
    """Rows of `seq_len + 1` tokens: a prose window, or a recall task (prompt + answer + eos) topped up
    with prose. Deterministic from `seed`."""

    def __init__(self, tokenizer: Tokenizer, docs: list[str], seq_len: int, task_fraction: float, seed: int,
                 answer_weight: float = 1.0):
        self.tok, self.seq_len, self.task_fraction, self.answer_weight = tokenizer, seq_len, task_fraction, answer_weight
        self.rng = random.Random(seed)
        self.stream = torch.tensor(
            [i for d in docs for i in tokenizer.encode(d).ids + [SPECIAL_TOKENS.index("</s>")]], dtype=torch.long
        )

    def prose(self, n: int) -> torch.Tensor:
        start = self.rng.randrange(len(self.stream) - n)
        return self.stream[start:start + n]

    def task(self) -> tuple[list[int], int]:
        """Token ids of prompt + answer + eos, and the number of prompt tokens."""
        name = self.rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
        target = self.rng.randint(48, self.seq_len - 16)
        prompt, continuation = task_text(name, self.rng.randrange(10**9), self.tok, target, self.rng.uniform(0, 100))
        prompt_ids = self.tok.encode(prompt).ids
        ids = prompt_ids + self.tok.encode(continuation, add_special_tokens=False).ids + [2]
        return ids[: self.seq_len + 1], len(prompt_ids)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, seq_len + 1] and target weights [B, seq_len]: `answer_weight` on task answers, else 1."""
        rows, weights = [], torch.ones(batch_size, self.seq_len)
        for r in range(batch_size):
            if self.rng.random() < self.task_fraction:
                ids, n_prompt = self.task()
                rows.append(torch.cat([torch.tensor(ids, dtype=torch.long), self.prose(self.seq_len + 1 - len(ids))]))
                weights[r, n_prompt - 1 : len(ids) - 1] = self.answer_weight  # targets are shifted by one
            else:
                rows.append(self.prose(self.seq_len + 1))
        return torch.stack(rows), weights


# ---------------------------------------------------------------------------------------------- eval
class _Encoder:
    """`hybrid.eval.tasks` wants `encode(text) -> ids`; a `tokenizers.Tokenizer` returns an Encoding."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


@torch.no_grad()
def answer_accuracy(model, tok: Tokenizer, task: str, length: int, n: int, seed: int = 12345) -> float:
    """Fraction of `n` task prompts of `length` tokens whose whole answer is the greedy continuation
    (checked teacher-forced: every answer token is the argmax given the prompt and the previous ones)."""
    hits = 0
    enc = _Encoder(tok)
    for i in range(n):
        s = fit_to_length(task, enc, length, seed + i, depth_percent=100.0 * i / max(n - 1, 1))
        prompt = tok.encode(s.prompt).ids
        answer = tok.encode(s.continuation, add_special_tokens=False).ids
        ids = torch.tensor([prompt + answer])
        logits = model(ids, logits_to_keep=len(answer) + 1)[0, :-1]
        hits += int(torch.equal(logits.argmax(-1), torch.tensor(answer)))
    return hits / n


@torch.no_grad()
def validation_loss(model, val: TrainingData, batches: list[torch.Tensor]) -> float:
    return sum(lm_loss(model, tokens)[1]["lm"] for tokens, _ in batches) / len(batches)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--preset", default="hybrid-mini", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=None, help="number of optimiser steps (schedule over steps)")
    p.add_argument("--time-budget", type=float, default=None, help="minutes of training (schedule over time)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the run spent warming up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--task-fraction", type=float, default=0.8, help="share of rows that are recall tasks")
    p.add_argument("--answer-weight", type=float, default=4.0, help="loss weight of recall-task answer tokens")
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--balance-rate", type=float, default=5e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=20, help="prompts per task in the final evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = p.parse_args(argv)
    if (args.steps is None) == (args.time_budget is None):
        p.error("give exactly one of --steps and --time-budget")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    check_destination(out, None, args.overwrite)  # before the run, not after it

    t0 = time.time()
    docs = prose_documents()
    val_docs, train_docs = docs[::20], [d for i, d in enumerate(docs) if i % 20]
    config = HybridConfig(**PRESETS[args.preset], torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.validate()
    tok = train_tokenizer(train_docs, config.vocab_size, args.seed)
    data = TrainingData(tok, train_docs, args.seq_len, args.task_fraction, args.seed, args.answer_weight)
    val = TrainingData(tok, val_docs, args.seq_len, 0.0, args.seed + 1)
    val_batches = [val.batch(args.batch_size) for _ in range(4)]
    print(f"data: {len(train_docs)} prose documents, {len(data.stream):,} training prose tokens, "
          f"{len(val.stream):,} validation; tokenizer {tok.get_vocab_size()} ({time.time() - t0:.1f}s)", file=sys.stderr)

    model = build_model(config, torch.float32, device="cpu")
    init_weights(model, args.seed)
    n_params = sum(t.numel() for t in model.state_dict().values())
    print(f"model: {config.hybrid_override_pattern} + MTP {config.mtp_pattern if config.num_nextn_predict_layers else '-'}, "
          f"{n_params:,} parameters", file=sys.stderr)
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and "embeddings" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if not (p_.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = ExpertBalancer(model, rate=args.balance_rate)

    history, step, tokens = [], 0, 0
    start = time.time()
    total = args.steps if args.steps else args.time_budget * 60
    bar = tqdm(total=args.steps or int(total), unit="step" if args.steps else "s", dynamic_ncols=True)
    while True:
        progress = step / args.steps if args.steps else (time.time() - start) / total
        if progress >= 1.0:
            break
        lr = learning_rate(progress, args.lr, args.warmup, final=0.1)
        batch, weights = data.batch(args.batch_size)
        done = train_step(model, opt, balancer, batch, weights, args.mtp_weight, lr)
        step += 1
        tokens += batch.numel()
        elapsed = time.time() - start
        bar.set_postfix(loss=f"{done['loss']:.3f}", mtp=f"{done['mtp_loss']:.3f}" if done["mtp_loss"] else "-",
                        lr=f"{lr:.1e}", tok_s=f"{tokens / elapsed:.0f}",
                        load=f"{done['max_over_mean_load']:.2f}" if done["max_over_mean_load"] else "-")
        bar.update(1 if args.steps else int(elapsed) - bar.n)
        record = {"step": step, "seconds": round(elapsed, 1), "tokens": tokens, "lr": lr, **done}
        if step % args.eval_every == 0:
            model.eval()
            record["val_loss"] = validation_loss(model, val, val_batches)
            record["passkey_acc"] = answer_accuracy(model, tok, "passkey", args.seq_len - 16, 8)
            record["kv_recall_acc"] = answer_accuracy(model, tok, "kv_recall", args.seq_len // 2, 8)
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), file=sys.stderr)
        history.append(record)
    bar.close()

    model.eval()
    final = {"val_loss": validation_loss(model, val, val_batches)}
    for task in TASK_WEIGHTS:
        final[f"{task}_acc@{args.seq_len - 16}"] = answer_accuracy(model, tok, task, args.seq_len - 16, args.eval_samples)
    summary = {"preset": args.preset, "args": vars(args), "parameters": n_params, "steps": step, "tokens": tokens,
               "train_seconds": round(time.time() - start, 1), "final_train_loss": history[-1]["loss"] if history else None,
               "final": final}
    print(json.dumps(summary, indent=1), file=sys.stderr)

    save_model = model.cast(torch_dtype(args.save_dtype))
    log = {"training_log.json": json.dumps({"summary": summary, "history": history}) + "\n"}
    # one write: the checkpoint, its tokenizer and the log appear together or not at all
    save_checkpoint(save_model, out, overwrite=args.overwrite, files={**tokenizer_files(tok), **log})
    return 0


def tokenizer_files(tok: Tokenizer) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in the Hugging Face layout."""
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config = {**special, "add_bos_token": True, "add_eos_token": False, "model_max_length": 1_000_000,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


if __name__ == "__main__":
    sys.exit(main())
