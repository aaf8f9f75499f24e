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
    """

    conv: torch.Tensor
    ssm: torch.Tensor


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


class HybridCache:
    """Inference state for a batch of `batch_size` sequences (see the module docstring).

    layers[i] is a `KVCache` for attention layers, a `MambaState` for Mamba layers, None otherwise.
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
    ):
        self.batch_size = batch_size
        self.seq_len = 0
        self.key_mask: torch.Tensor | None = None
        ssm_dtype = _DTYPES[config.mamba_ssm_cache_dtype]
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

    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """Account for `num_tokens` new positions with real-token `mask` [B, T] (or None); return the context.

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
