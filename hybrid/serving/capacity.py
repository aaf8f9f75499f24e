"""How many sequences and tokens a memory budget holds: the two pools of a hybrid model's server.

A server of a hybrid model holds two kinds of state besides the weights (as vLLM does for hybrid models):
- a **state slot** per running sequence: every Mamba layer's conv window and fp32 SSM state, a fixed size
  whatever the sequence's length (Nemotron 3 Nano: 46.8 MiB), which cannot be paged or cut;
- **KV blocks** of `block_size` tokens for the attention layers, taken by a sequence as it grows.

    free = budget - weights - reserve                  (reserve: activations and the runtime)
    one sequence of L tokens = state + ceil(L / block_size) x block bytes
    concurrency at L = min(max_num_seqs, free // (one sequence of L tokens))

with the free bytes shared between the two kinds as the sequences need them. Which kind takes more of a
sequence's bytes at L says what bounds concurrency there: for Nano one state weighs as much as 8K tokens of
KV, so below 8K tokens the state slots, not the KV, bound the server. Everything here is computed from a
config without weights (`hybrid.accounting.describe`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

from hybrid.accounting import describe
from hybrid.config import HybridConfig
from moe.quant.config import QuantConfig

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
DEFAULT_RESERVE = 2**30  # bytes kept for activations and the runtime
REPORT_LENGTHS = (1024, 8192, 32768, 131072)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"32GB" -> 32 * 10**9, "24GiB" -> 24 * 2**30, "512MB", "1.5GB", "1000" (bytes).

    Raises:
        ValueError: not a positive number with one of the units B, KB, MB, GB, TB (powers of 1000) or KiB,
            MiB, GiB, TiB (powers of 1024); the message repeats `text`.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a memory size: expected a positive number with a unit such as 32GB, "
                         "24GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass
class Capacity:
    """The memory plan for one budget (bytes unless named otherwise). `fits` is False when the weights and
    the reserve leave no room for one sequence of `max_model_len` tokens."""

    budget_bytes: int
    weight_bytes: int
    reserve_bytes: int
    free_bytes: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    bytes_per_full_sequence: int  # one state + the KV blocks of max_model_len tokens
    fits: bool
    concurrency: dict[int, int]  # {length: sequences of that length that fit at once}
    state_equals_kv_tokens: float  # one state weighs as much as this many tokens of KV (inf: no attention)
    tensor_parallel: int = 1  # > 1: the plan of one rank of that many (its weights and its part of the caches)

    def sequence_bytes(self, length: int) -> int:
        """Bytes of one sequence of `length` tokens: its state and its KV blocks."""
        return self.state_bytes_per_sequence + math.ceil(length / self.block_size) * self.block_size * \
            self.kv_bytes_per_token

    def bound_at(self, length: int) -> str:
        """What caps concurrency at `length` tokens: "max_num_seqs", "state slots" (the states take more of
        the bytes) or "KV blocks"."""
        if self.concurrency.get(length) == self.max_num_seqs:
            return "max_num_seqs"
        kv = self.sequence_bytes(length) - self.state_bytes_per_sequence
        return "state slots" if self.state_bytes_per_sequence >= kv else "KV blocks"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["concurrency"] = {str(k): v for k, v in self.concurrency.items()}
        d["state_equals_kv_tokens"] = None if math.isinf(self.state_equals_kv_tokens) else self.state_equals_kv_tokens
        return d


def plan(config: HybridConfig, dtype: torch.dtype, budget_bytes: int, quant: QuantConfig | None = None,
         max_model_len: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
         block_size: int = DEFAULT_BLOCK_SIZE, reserve_bytes: int = DEFAULT_RESERVE,
         ranks: list[dict] | None = None) -> Capacity:
    """What `budget_bytes` holds for `config` in `dtype` (and `quant`, for packed weight sizes): concurrency
    at `REPORT_LENGTHS` and `max_model_len` (default: the config's max_position_embeddings). With `ranks` (the
    "ranks" of `hybrid.accounting.describe_ranks`, more than one), the budget is one rank's (one device's): the
    largest rank's weights and a rank's KV heads and Mamba heads.

    Raises:
        ValueError: a size argument below 1 (reserve below 0).
    """
    max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
    for name, value in (("budget_bytes", budget_bytes), ("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    tensor_parallel = len(ranks) if ranks else 1
    if tensor_parallel > 1:
        weights, kv_token, state = (max(r[k] for r in ranks) for k in (
            "weight_bytes", "kv_cache_bytes_per_token", "mamba_state_bytes_per_sequence"))
    else:
        report = describe(config, dtype, quant)
        weights, kv_token = report["weight_bytes"], report["kv_cache_bytes_per_token"]
        state = report["mamba_state_bytes_per_sequence"]
    free = budget_bytes - weights - reserve_bytes
    c = Capacity(budget_bytes, weights, reserve_bytes, free, block_size, max_model_len, max_num_seqs,
                 kv_token, state, 0, False, {}, state / kv_token if kv_token else math.inf, tensor_parallel)
    c.bytes_per_full_sequence = c.sequence_bytes(max_model_len)
    c.fits = free >= c.bytes_per_full_sequence
    for length in sorted({n for n in REPORT_LENGTHS if n < max_model_len} | {max_model_len}):
        per = c.sequence_bytes(length)
        c.concurrency[length] = min(max_num_seqs, max(free, 0) // per) if per else max_num_seqs
    return c
