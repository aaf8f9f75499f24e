"""The inference state of a batch: per layer, a KV cache (attention) or a conv window and SSM state (Mamba).

`Cache` is the interface the model, its layers and the prefix cache use; `HybridCache` is its dense
implementation (every row in preallocated tensors). Every forward on a cache appends its tokens, whatever
their number, so prefill, chunked prefill, decode and the verification of several draft tokens are one code
path (tests/test_cases.py, case 6).

The layers reach their state only through `Cache.layer(i)`, which gives
- an attention layer a handle with `update(k, v, start) -> (keys, values)`: append this forward's keys and
  values and read all of them (`KVCache`);
- a Mamba layer a handle with `conv` [B, conv_dim, K-1] and `ssm` [B, nh, P, N] tensors that it reads and
  updates in place, and `history`, where a recorded forward keeps the state after each token
  (`MambaState`).
The prefix cache uses only `snapshot_kv`, `snapshot_mamba` and `restore` (per row: the keys and values over a
token range, the Mamba states at the row's end).

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
    """

    lengths: list[int]
    past: list[int]

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
    record: the Mamba layers keep their state after each token (see `Cache.rollback`).
    packed: the sequences packed in the single row of this forward (see the module docstring), or None;
        then `past`, `mask` and `key_mask` are 0, None and None, and each sequence's own past is in `packed`.
    """

    past: int
    mask: torch.Tensor | None
    key_mask: torch.Tensor | None
    record: bool = False
    packed: PackedSeqs | None = None

    def for_sequence(self, s: int) -> "StepContext":
        """The context of packed sequence `s` alone (its own past, no padding)."""
        return StepContext(past=self.packed.past[s], mask=None, key_mask=None)


@dataclass
class MambaState:
    """Constant-size state of one Mamba-2 layer (the handle a Mamba mixer gets from `Cache.layer`).

    conv: [B, conv_dim, conv_kernel - 1], model dtype: the last K-1 inputs of the causal conv.
    ssm: [B, mamba_num_heads, mamba_head_dim, ssm_state_size], fp32 (`mamba_ssm_cache_dtype`).
    history: while a forward records, the (conv, ssm) state after each of its tokens, so that
        `Cache.rollback` can return to any of them.
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    history: list[tuple[torch.Tensor, torch.Tensor]] | None = None


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
    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None, record: bool = False) -> StepContext:
        """Account for `num_tokens` new positions with real-token `mask` [B, T] (or None); return the context
        the layers of this forward read."""

    @abstractmethod
    def layer(self, i: int) -> KVCache | MambaState | None:
        """The state handle of layer `i` (of the pattern the cache was made for): see the module docstring."""

    @abstractmethod
    def rollback(self, keep: int) -> None:
        """Keep the first `keep` tokens of the last recorded forward and forget the rest."""

    @abstractmethod
    def snapshot_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s keys and values over positions [start, end), per attention layer:
        (k, v) [num_key_value_heads, end - start, head_dim]."""

    @abstractmethod
    def snapshot_mamba(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s Mamba states at its current end, per Mamba layer: (conv [conv_dim, K-1],
        ssm [nh, P, N])."""

    @abstractmethod
    def restore(self, row: int, length: int, kv: list[tuple[torch.Tensor, torch.Tensor]],
                mamba: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make row `row` hold `length` real positions: `kv` per attention layer ([nkv, length, hd] each) and
        the Mamba states `mamba` at their end (the forms `snapshot_kv` and `snapshot_mamba` return)."""


class HybridCache(Cache):
    """The dense inference state of `batch_size` sequences (see the module docstring); all rows share one
    length (shorter rows are padded and masked).

    layers[i] is a `KVCache` for attention layers, a `MambaState` for Mamba layers, None otherwise, one per
    character of `pattern` (default: the main stack's; the MTP block's cache uses `config.mtp_pattern`).
    """

    def __init__(
        self,
        config: HybridConfig,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 0,
        pattern: str | None = None,
    ):
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seq_len = 0
        self.key_mask: torch.Tensor | None = None
        self._recorded = 0
        ssm_dtype = torch_dtype(config.mamba_ssm_cache_dtype)
        self.layers: list[KVCache | MambaState | None] = []
        for kind in config.hybrid_override_pattern if pattern is None else pattern:
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

    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None, record: bool = False) -> StepContext:
        """See `Cache.begin`. With `record`, the Mamba layers keep their state after each new token, so that
        `rollback` can later keep only a prefix of them (speculative decoding verifies several draft tokens
        in one forward).

        Raises:
            ValueError: the batch size differs from the cache's, or `record` is combined with padding.
        """
        if batch_size != self.batch_size:
            raise ValueError(f"input batch size {batch_size} does not match the cache's batch size {self.batch_size}")
        if record and mask is not None:
            raise ValueError("a recorded forward (for rollback) cannot carry padding")
        self._recorded = num_tokens if record else 0
        past = self.seq_len
        if mask is not None or self.key_mask is not None:
            device = mask.device if mask is not None else self.key_mask.device
            old = self.key_mask if self.key_mask is not None else torch.ones(batch_size, past, dtype=torch.bool, device=device)
            new = mask if mask is not None else torch.ones(batch_size, num_tokens, dtype=torch.bool, device=device)
            self.key_mask = torch.cat([old, new], dim=1)
        self.seq_len = past + num_tokens
        return StepContext(past=past, mask=mask, key_mask=self.key_mask, record=record)

    # ------------------------------------------------------------------------------------------ rollback
    def rollback(self, keep: int) -> None:
        """Keep the first `keep` tokens of the last recorded forward and forget the rest.

        Attention layers simply stop at the new length (their later entries are overwritten by the next
        forward); Mamba layers return to the state they recorded after token `keep`.
        Raises:
            ValueError: the last forward was not recorded, or `keep` is not in [1, its token count].
        """
        if not self._recorded:
            raise ValueError("rollback needs a recorded forward (begin(..., record=True))")
        if not 1 <= keep <= self._recorded:
            raise ValueError(f"keep must be in [1, {self._recorded}], got {keep}")
        self.seq_len -= self._recorded - keep
        if self.key_mask is not None:
            self.key_mask = self.key_mask[:, : self.seq_len]
        for layer in self.layers:
            if isinstance(layer, MambaState) and layer.history is not None:
                conv, ssm = layer.history[keep - 1]
                layer.conv.copy_(conv)
                layer.ssm.copy_(ssm)
                layer.history = None
        self._recorded = 0

    def truncate(self, seq_len: int) -> None:
        """Drop every position from `seq_len` on. Only for caches without Mamba layers (the MTP block's):
        a Mamba state cannot be rewound without a recording.

        Raises:
            ValueError: the cache has Mamba layers, or `seq_len` exceeds the stored length.
        """
        if any(isinstance(layer, MambaState) for layer in self.layers):
            raise ValueError("truncate cannot rewind Mamba states; record the forward and use rollback")
        if not 0 <= seq_len <= self.seq_len:
            raise ValueError(f"seq_len must be in [0, {self.seq_len}], got {seq_len}")
        self.seq_len = seq_len
        if self.key_mask is not None:
            self.key_mask = self.key_mask[:, :seq_len]

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

    def restore(self, row: int, length: int, kv: list[tuple[torch.Tensor, torch.Tensor]],
                mamba: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """See `Cache.restore`. The rows of a dense cache share one length: the cache must be empty (it then
        holds `length` positions) or already hold `length`.

        Raises:
            ValueError: another length is stored, or the snapshot does not have this cache's layers.
        """
        if self.seq_len not in (0, length):
            raise ValueError(f"cannot restore {length} positions into a cache holding {self.seq_len}")
        kv_layers, mamba_layers = self._kv_layers(), self._mamba_layers()
        if len(kv) != len(kv_layers) or len(mamba) != len(mamba_layers):
            raise ValueError(f"the snapshot has {len(kv)} attention and {len(mamba)} Mamba layers; this cache has "
                             f"{len(kv_layers)} and {len(mamba_layers)}")
        for layer, (k, v) in zip(kv_layers, kv):
            layer.reserve(length)
            layer.k[row, :, :length] = k
            layer.v[row, :, :length] = v
        for layer, (conv, ssm) in zip(mamba_layers, mamba):
            layer.conv[row].copy_(conv)
            layer.ssm[row].copy_(ssm)
        self.seq_len = length

    def fill_rows(self, rows: list[Cache]) -> None:
        """Fill this empty cache, row by row, from batch-1 caches of the same model (copies).

        Rows of different lengths are right-aligned, the earlier positions of shorter rows masked out, so
        each row continues as it would alone (as with left padding).
        Raises:
            ValueError: this cache is not empty, or the row count or a row's batch size does not match.
        """
        if self.seq_len:
            raise ValueError("fill_rows needs an empty cache")
        if len(rows) != self.batch_size or any(r.batch_size != 1 for r in rows):
            raise ValueError(f"fill_rows needs {self.batch_size} batch-1 caches")
        S = max(r.seq_len for r in rows)
        key_mask = torch.zeros(self.batch_size, S, dtype=torch.bool)
        kv_layers, mamba_layers = self._kv_layers(), self._mamba_layers()
        for layer in kv_layers:
            layer.reserve(S)
        for b, row in enumerate(rows):
            off = S - row.seq_len
            key_mask[b, off:] = True if row.key_mask is None else row.key_mask[0].cpu()
            for layer, (k, v) in zip(kv_layers, row.snapshot_kv(0, 0, row.seq_len)):
                layer.k[b, :, off:S] = k
                layer.v[b, :, off:S] = v
            for layer, (conv, ssm) in zip(mamba_layers, row.snapshot_mamba(0)):
                layer.conv[b] = conv
                layer.ssm[b] = ssm
        self.seq_len = S
        self.key_mask = None if bool(key_mask.all()) else key_mask.to(self.device)

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
