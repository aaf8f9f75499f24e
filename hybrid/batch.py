"""One batch from token sequences of different lengths: left-padded, with the mask of real tokens.

Padding is masked everywhere (see `hybrid.cache`), so each row of the batch behaves as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LeftPadded:
    """ids [B, L] int64, mask [B, L] bool (True for real tokens), offsets: where each row's tokens start."""

    ids: torch.Tensor
    mask: torch.Tensor
    offsets: list[int]


def left_pad(sequences: list[list[int]], pad_id: int | None = 0, device: torch.device | str = "cpu") -> LeftPadded:
    """Right-align `sequences` (B non-empty token id lists) in a [B, max length] batch, padding with `pad_id`.

    Any pad id serves (None is 0): the model never looks up padded positions, so an id past the vocabulary
    (a `<pad>` added to the tokenizer) or -1 is fine, and a real token id is masked like any other.
    """
    B, L = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((B, L), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    offsets = []
    for row, seq in enumerate(sequences):
        offsets.append(L - len(seq))
        ids[row, offsets[-1]:] = torch.tensor(seq, dtype=torch.long)
        mask[row, offsets[-1]:] = True
    return LeftPadded(ids.to(device), mask.to(device), offsets)
