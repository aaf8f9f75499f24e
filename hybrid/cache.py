"""The inference state's interface: what the model and its layers see of a cache, and how a step packs sequences.

There is one cached path: every forward on a cache is a packed step (`StepContext.packed`, a `PackedSeqs`): the
new tokens of one or more sequences one after another in a single row, with no padding, each sequence's state
in its own KV blocks and state slot (`hybrid.serving.paged_cache`: the engine's `PagedCache`, and the
`BatchCache` that `HybridForCausalLM.new_cache` gives for step-by-step use). The projections run once over every
token; the layers split the row into its sequences only for what couples tokens of one sequence (attention,
the conv window, the SSM recurrence). Every step appends its tokens whatever their number, so prefill, chunked
prefill, decode and the verification of draft tokens are one code path (tests/test_cases.py, case 6).

The layers reach their state only through `Cache.layer(i)`, which gives
- an attention layer a handle whose `seq(s)` has `update(k, v, start) -> (keys, values)` (store this step's
  keys and values of sequence s, read all of its), and whose `attend_decode` stores and attends one token of
  each of several sequences over their rows of the pool;
- a Mamba layer a handle whose `seq(s)` is a `MambaState` of views of sequence s's slot (`conv`
  [1, conv_dim, K-1] and `ssm` [1, nh, P, N], read and updated in place), whose `rows(seqs)` gives the pools and
  the slots of several sequences (one decode step over all of them), and whose `keep(t, seqs)` keeps verifying
  sequences' states after their token t (speculative decoding's rollback).
The prefix cache uses only `snapshot_kv` and `snapshot_mamba` (per sequence: the keys and values over a token
range, the Mamba states at its end).

Without a cache, a forward may carry a `[B, T]` mask of real tokens (padding for scoring and training):
masked positions never reach a Mamba state (dt = 0, the conv window skips them) and attention never attends to
them; positions carry no meaning otherwise (no RoPE), so a padded row gives its logits alone.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

# New tokens a generation reserves KV blocks for up front; past them the pool grows geometrically
# (`GrowingBlockPool`), so a max_new_tokens far past memory (10**12) costs nothing until that many tokens are
# really generated.
RESERVE_AHEAD = 4096


@dataclass
class PackedSeqs:
    """Several sequences' new tokens packed one after another in one row (input [1, sum(lengths)]).

    lengths: new tokens of each sequence, in packed order (each >= 1).
    past: positions each sequence already holds in its state before this forward.
    verifying: the sequences whose tokens verify draft tokens (speculative decoding): the Mamba layers keep
        their state after each of those tokens but the last (`handle.keep`), so that the engine can return
        to the state after the last accepted one.
    """

    lengths: list[int]
    past: list[int]
    verifying: frozenset[int] = frozenset()

    @functools.cached_property
    def decode_only(self) -> bool:
        """Whether every sequence brings one token (a decode step): the layers then take all rows at once."""
        return all(n == 1 for n in self.lengths)

    def segments(self):
        """(sequence index, start, end) of each sequence's tokens in the packed row."""
        start = 0
        for s, n in enumerate(self.lengths):
            yield s, start, start + n
            start += n


@dataclass
class StepContext:
    """What the layers of one forward need to know about the tokens they see.

    past: positions before this forward's (0 without a cache; a packed sequence's own: `for_sequence`).
    mask: [B, T] bool, True for real tokens, or None when every token is real (a forward without a cache).
    key_mask: [B, past + T] bool over every position attention may look at, or None when all are real.
    packed: the sequences packed in the single row of this forward (see the module docstring), or None
        without a cache; with it `past`, `mask` and `key_mask` are 0, None and None.
    """

    past: int
    mask: torch.Tensor | None
    key_mask: torch.Tensor | None
    packed: PackedSeqs | None = None

    def for_sequence(self, s: int) -> "StepContext":
        """The context of packed sequence `s` alone (its own past, no padding)."""
        return StepContext(past=self.packed.past[s], mask=None, key_mask=None)


@dataclass
class MambaState:
    """Constant-size state of one Mamba-2 layer for B sequences (a packed sequence's handle: `handle.seq(s)`).

    conv: [B, conv_dim, conv_kernel - 1], model dtype: the last K-1 inputs of the causal conv.
    ssm: [B, mamba_num_heads, mamba_head_dim, ssm_state_size], fp32 (`mamba_ssm_cache_dtype`).
    """

    conv: torch.Tensor
    ssm: torch.Tensor


class Cache(ABC):
    """The inference state of a batch of sequences, as the model and the prefix cache use it.

    `seq_len` counts the positions every sequence holds before the next forward (0 for a packed step, whose
    sequences' lengths differ: `PackedSeqs.past`).
    """

    batch_size: int
    seq_len: int

    @abstractmethod
    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """Account for `num_tokens` new positions with real-token `mask` [B, T] (or None); return the context
        the layers of this forward read."""

    @abstractmethod
    def layer(self, i: int):
        """The state handle of layer `i` (of the pattern the cache was made for): see the module docstring."""

    @abstractmethod
    def snapshot_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s keys and values over positions [start, end), per attention layer:
        (k, v) [num_key_value_heads, end - start, head_dim]."""

    @abstractmethod
    def snapshot_mamba(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s Mamba states at its current end, per Mamba layer: (conv [conv_dim, K-1],
        ssm [nh, P, N])."""
