"""The inference state of a batch: per layer, a KV cache (attention) or a conv window and SSM state (Mamba).

One object per batch. Every forward on it appends its tokens, whatever their number, so prefill, chunked
prefill, decode and the verification of several draft tokens are one code path (tests/test_cases.py, case 6).

Padding: a forward may carry a `[B, T]` mask of real tokens. Masked positions are "not there": they never
reach a Mamba state (dt = 0, the conv window skips them) and attention never attends to them. The cache
keeps the mask of every position it holds (`key_mask`) so later steps keep ignoring them. Positions carry
no meaning otherwise (no RoPE), so a left- or right-padded row continues exactly as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.config import ATTENTION, MAMBA, HybridConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MambaState:
    """Constant-size state of one Mamba-2 layer.

    conv: [B, conv_dim, conv_kernel - 1], model dtype: the last K-1 inputs of the causal conv.
    ssm: [B, mamba_num_heads, mamba_head_dim, ssm_state_size], fp32 (`mamba_ssm_cache_dtype`).
    history: while a forward records (`HybridCache.begin(..., record=True)`), the (conv, ssm) state after
        each of its tokens, so that `HybridCache.rollback` can return to any of them.
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    history: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class KVCache:
    """Keys and values of one attention layer, preallocated and grown geometrically.

    k, v: [B, num_key_value_heads, capacity, head_dim]; positions [0, seq_len) are valid.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype, device, capacity: int = 0):
        self.k = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, nkv, T, hd] at positions [start, start+T); return views of [0, start+T)."""
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            self._grow(max(end, 2 * self.k.shape[2]))
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, capacity: int) -> None:
        old = self.k.shape[2]
        for name in ("k", "v"):
            t = getattr(self, name)
            new = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
            new[:, :, :old] = t
            setattr(self, name, new)


@dataclass
class StepContext:
    """What the layers of one forward need to know about the tokens they see.

    past: positions already in the cache before this forward.
    mask: [B, T] bool, True for real tokens, or None when every token is real.
    key_mask: [B, past + T] bool over every position attention may look at, or None when all are real.
    """

    past: int
    mask: torch.Tensor | None
    key_mask: torch.Tensor | None
    record: bool = False


class HybridCache:
    """Inference state for a batch of `batch_size` sequences (see the module docstring).

    layers[i] is a `KVCache` for attention layers, a `MambaState` for Mamba layers, None otherwise, one per
    character of `pattern` (default: the main stack's; the MTP block's cache uses `config.mtp_pattern`).
    `seq_len` counts the positions stored (padding included); `key_mask` [B, seq_len] marks the real ones
    (None while every position is real).
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
        ssm_dtype = _DTYPES[config.mamba_ssm_cache_dtype]
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

    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None, record: bool = False) -> StepContext:
        """Account for `num_tokens` new positions with real-token `mask` [B, T] (or None); return the context.

        With `record`, the Mamba layers keep their state after each new token, so that `rollback` can later
        keep only a prefix of them (speculative decoding verifies several draft tokens in one forward).
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

    def fill_rows(self, rows: list["HybridCache"]) -> None:
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
        for b, row in enumerate(rows):
            off = S - row.seq_len
            key_mask[b, off:] = True if row.key_mask is None else row.key_mask[0].cpu()
            for mine, theirs in zip(self.layers, row.layers):
                if isinstance(mine, KVCache):
                    if mine.k.shape[2] < S:
                        mine._grow(S)
                    mine.k[b, :, off:S] = theirs.k[0, :, : row.seq_len]
                    mine.v[b, :, off:S] = theirs.v[0, :, : row.seq_len]
                elif isinstance(mine, MambaState):
                    mine.conv[b] = theirs.conv[0]
                    mine.ssm[b] = theirs.ssm[0]
        self.seq_len = S
        self.key_mask = None if bool(key_mask.all()) else key_mask.to(self.device)

    # ------------------------------------------------------------------------------------------ sizes
    def kv_nbytes(self) -> int:
        """Bytes of the attention layers' keys and values for the stored positions."""
        return sum(
            2 * layer.k[:, :, : self.seq_len].nelement() * layer.k.element_size()
            for layer in self.layers
            if isinstance(layer, KVCache)
        )

    def state_nbytes(self) -> int:
        """Bytes of the Mamba layers' conv windows and SSM states (independent of the sequence length)."""
        return sum(
            layer.conv.nelement() * layer.conv.element_size() + layer.ssm.nelement() * layer.ssm.element_size()
            for layer in self.layers
            if isinstance(layer, MambaState)
        )

    def nbytes(self) -> int:
        """Total bytes of inference state for the stored positions: KV + Mamba state."""
        return self.kv_nbytes() + self.state_nbytes()
