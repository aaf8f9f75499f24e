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
from dataclasses import dataclass, field

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
    device: where the step's index tensors live (`index`): the model's.

    The layers' groups of sequences (`singles`, `chunks`, `ones`) are host lists; their positions and the cache's
    slots and block tables reach the device as `index` tensors, all made in one copy before the layers run
    (`prepare`), so that no layer waits for a host-to-device copy (on a GPU a plain copy from pageable memory
    synchronises with the device).
    """

    lengths: list[int]
    past: list[int]
    verifying: frozenset[int] = frozenset()
    device: torch.device | str = "cpu"
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    @functools.cached_property
    def ones(self) -> list[tuple[int, int]]:
        """(sequence, row) of every one-token sequence (attention attends them together)."""
        return [(s, s0) for s, s0, s1 in self.segments() if s1 - s0 == 1]

    @functools.cached_property
    def singles(self) -> list[tuple[int, int]]:
        """(sequence, row) of the one-token sequences that do not verify (the Mamba layers step them together)."""
        return [(s, s0) for s, s0 in self.ones if s not in self.verifying]

    @functools.cached_property
    def chunks(self) -> list[tuple[int, int, int]]:
        """(sequence, start, end) of the sequences of several tokens that do not verify (prompt chunks)."""
        return [seg for seg in self.segments() if seg[2] - seg[1] > 1 and seg[0] not in self.verifying]

    def index(self, values) -> torch.Tensor:
        """`values` (ints) as an int64 tensor [len(values)] on `device`: the one `prepare` made for them, or,
        for values it did not name, one made now (and kept for the rest of the step)."""
        key = tuple(values)
        if key not in self._index:
            self._index[key] = torch.tensor(key, dtype=torch.long).to(self.device)
        return self._index[key]

    def prepare(self, more=()) -> None:
        """Make the `index` tensors of the layers' own groups and of the sequences of ints `more` (the cache's
        slots, block tables, ...) in one host-to-device copy (from pinned memory on a GPU, not waiting for it)."""
        wanted = [[s0 for _, s0 in self.ones], [s0 for _, s0 in self.singles], [s0 for _, s0, _ in self.chunks],
                  [s1 - s0 for _, s0, s1 in self.chunks], *more]
        keys = list(dict.fromkeys(tuple(int(v) for v in w) for w in wanted if w))
        keys = [k for k in keys if k not in self._index]
        if not keys:
            return
        host = torch.tensor([v for k in keys for v in k], dtype=torch.long)
        device = torch.device(self.device)
        if device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True)
        start = 0
        for k in keys:
            self._index[k] = flat[start:start + len(k)]
            start += len(k)


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
