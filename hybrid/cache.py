"""The inference state of a batch: per layer, a KV cache (attention) or a conv window and SSM state (Mamba).

`Cache` is the interface the model, its layers and the prefix cache use; `HybridCache` is its dense
implementation (every row in preallocated tensors). Every forward on a cache appends its tokens, whatever
their number, so prefill, chunked prefill, decode and the verification of several draft tokens are one code
path (tests/test_cases.py, case 6).

The layers reach their state only through `Cache.layer(i)`, which gives
- an attention layer a handle with `update(k, v, start) -> (keys, values)`: append this forward's keys and
  values and read all of them (`KVCache`);
- a Mamba layer a handle with `conv` [B, conv_dim, K-1] and `ssm` [B, nh, P, N] tensors that it reads and
  updates in place (`MambaState`).
The prefix cache uses only `snapshot_kv` and `snapshot_mamba` (per row: the keys and values over a token
range, the Mamba states at the row's end).

Packing: a forward may instead carry the new tokens of several sequences one after another in a single row
(`StepContext.packed`, a `PackedSeqs`; the serving engine's `hybrid.serving.paged_cache.PagedCache`), with no
padding at all. The projections then run once over every token; the layers split the row into its sequences
only for what couples tokens of one sequence (attention, the conv window, the SSM recurrence), and reach
each sequence's state through `handle.seq(s)`, which gives the same per-sequence handles as above (an
attention handle with `update`, a `MambaState` of batch 1 viewing the sequence's slot, updated in place).

Padding: a forward may carry a `[B, T]` mask of real tokens. Masked positions are "not there": they never
reach a Mamba state (dt = 0, the conv window skips them) and attention never attends to them. The cache
keeps the mask of every position it holds (`key_mask`) so later steps keep ignoring them. Positions carry
no meaning otherwise (no RoPE), so a left- or right-padded row continues exactly as it would alone.
"""

from __future__ import annotations

import functools

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from hybrid.config import ATTENTION, MAMBA, HybridConfig
from hybrid.dtypes import torch_dtype


# New tokens a generation reserves KV for up front; past them the cache grows geometrically (`KVCache.reserve`),
# so a max_new_tokens far past memory (10**12) costs nothing until that many tokens are really generated.
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

    past: positions already in the cache before this forward.
    mask: [B, T] bool, True for real tokens, or None when every token is real.
    key_mask: [B, past + T] bool over every position attention may look at, or None when all are real.
    packed: the sequences packed in the single row of this forward (see the module docstring), or None;
        then `past`, `mask` and `key_mask` are 0, None and None, and each sequence's own past is in `packed`.
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
    """Constant-size state of one Mamba-2 layer (the handle a Mamba mixer gets from `Cache.layer`).

    conv: [B, conv_dim, conv_kernel - 1], model dtype: the last K-1 inputs of the causal conv.
    ssm: [B, mamba_num_heads, mamba_head_dim, ssm_state_size], fp32 (`mamba_ssm_cache_dtype`).
    """

    conv: torch.Tensor
    ssm: torch.Tensor


class KVCache:
    """Keys and values of one attention layer, preallocated and grown geometrically (the handle an attention
    layer gets from `Cache.layer`).

    k, v: [B, num_key_value_heads, capacity, head_dim]; positions [0, seq_len) are valid.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype, device, capacity: int = 0):
        self.k = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's k, v [B, nkv, T, hd] at positions [start, start+T) (`start` = the forward's
        `ctx.past`); return views of all keys and values, [0, start+T)."""
        end = start + k.shape[2]
        self.reserve(end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` positions (at least doubling when it grows), keeping what is stored."""
        old = self.k.shape[2]
        if capacity <= old:
            return
        for name in ("k", "v"):
            t = getattr(self, name)
            new = t.new_zeros(*t.shape[:2], max(capacity, 2 * old), t.shape[3])
            new[:, :, :old] = t
            setattr(self, name, new)


class Cache(ABC):
    """The inference state of a batch of sequences, as the model and the prefix cache use it.

    `seq_len` counts the positions stored (padding included); `key_mask` [B, seq_len] marks the real ones
    (None while every position is real).
    """

    batch_size: int
    seq_len: int
    key_mask: torch.Tensor | None

    @abstractmethod
    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """Account for `num_tokens` new positions with real-token `mask` [B, T] (or None); return the context
        the layers of this forward read."""

    @abstractmethod
    def layer(self, i: int) -> KVCache | MambaState | None:
        """The state handle of layer `i` (of the pattern the cache was made for): see the module docstring."""

    @abstractmethod
    def snapshot_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s keys and values over positions [start, end), per attention layer:
        (k, v) [num_key_value_heads, end - start, head_dim]."""

    @abstractmethod
    def snapshot_mamba(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s Mamba states at its current end, per Mamba layer: (conv [conv_dim, K-1],
        ssm [nh, P, N])."""


class HybridCache(Cache):
    """The dense inference state of `batch_size` sequences (see the module docstring); all rows share one
    length (shorter rows are padded and masked).

    layers[i] is a `KVCache` for attention layers, a `MambaState` for Mamba layers, None otherwise, one per
    layer of the main stack.
    """

    def __init__(
        self,
        config: HybridConfig,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 0,
    ):
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seq_len = 0
        self.key_mask: torch.Tensor | None = None
        ssm_dtype = torch_dtype(config.mamba_ssm_cache_dtype)
        self.layers: list[KVCache | MambaState | None] = []
        for kind in config.hybrid_override_pattern:
            if kind == ATTENTION:
                self.layers.append(
                    KVCache(batch_size, config.num_key_value_heads, config.head_dim, dtype, device, capacity)
                )
            elif kind == MAMBA:
                self.layers.append(
                    MambaState(
                        conv=torch.zeros(batch_size, config.conv_dim, config.conv_kernel - 1, dtype=dtype, device=device),
                        ssm=torch.zeros(
                            batch_size, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                            dtype=ssm_dtype, device=device,
                        ),
                    )
                )
            else:
                self.layers.append(None)

    def layer(self, i: int) -> KVCache | MambaState | None:
        return self.layers[i]

    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """See `Cache.begin`.

        Raises:
            ValueError: the batch size differs from the cache's.
        """
        if batch_size != self.batch_size:
            raise ValueError(f"input batch size {batch_size} does not match the cache's batch size {self.batch_size}")
        past = self.seq_len
        if mask is not None or self.key_mask is not None:
            device = mask.device if mask is not None else self.key_mask.device
            old = self.key_mask if self.key_mask is not None else torch.ones(batch_size, past, dtype=torch.bool, device=device)
            new = mask if mask is not None else torch.ones(batch_size, num_tokens, dtype=torch.bool, device=device)
            self.key_mask = torch.cat([old, new], dim=1)
        self.seq_len = past + num_tokens
        return StepContext(past=past, mask=mask, key_mask=self.key_mask)

    # ------------------------------------------------------------------------------------------ snapshots
    def _kv_layers(self) -> list[KVCache]:
        return [layer for layer in self.layers if isinstance(layer, KVCache)]

    def _mamba_layers(self) -> list[MambaState]:
        return [layer for layer in self.layers if isinstance(layer, MambaState)]

    def snapshot_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not 0 <= start <= end <= self.seq_len:
            raise ValueError(f"positions [{start}, {end}) are not within the {self.seq_len} stored")
        return [(kv.k[row, :, start:end].clone(), kv.v[row, :, start:end].clone()) for kv in self._kv_layers()]

    def snapshot_mamba(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(m.conv[row].clone(), m.ssm[row].clone()) for m in self._mamba_layers()]

    # ------------------------------------------------------------------------------------------ sizes
    def kv_nbytes(self) -> int:
        """Bytes of the attention layers' keys and values for the stored positions."""
        return sum(2 * layer.k[:, :, : self.seq_len].nelement() * layer.k.element_size() for layer in self._kv_layers())

    def state_nbytes(self) -> int:
        """Bytes of the Mamba layers' conv windows and SSM states (independent of the sequence length)."""
        return sum(layer.conv.nelement() * layer.conv.element_size() + layer.ssm.nelement() * layer.ssm.element_size()
                   for layer in self._mamba_layers())

    def nbytes(self) -> int:
        """Total bytes of inference state for the stored positions: KV + Mamba state."""
        return self.kv_nbytes() + self.state_nbytes()
