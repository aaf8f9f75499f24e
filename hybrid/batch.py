"""One batch from token sequences of different lengths: left-padded, with the mask of real tokens.

Padding is masked everywhere (see `hybrid.cache`), so each row of the batch behaves as it would alone.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

INT64 = (-2**63, 2**63)


def check_prompts(prompts, vocab_size: int) -> None:
    """Refuse what cannot become a batch of token ids: the entry check of `generate_ids` (the model's forward
    checks the range of ids in tensors, `HybridForCausalLM._check_ids`; here only ints too large for int64
    are refused for their value, named the same way).

    Raises:
        ValueError: `prompts` not a non-empty list / tuple of lists / tuples, an empty prompt, or an id that is
            not a Python int (a bool, a float, a string: named by row and position, with the vocabulary).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {prompts!r:.80}")
    for row, prompt in enumerate(prompts):
        check_prompt(prompt, vocab_size, f"prompts[{row}]")


def check_prompt(prompt, vocab_size: int, where: str, in_vocabulary: bool = False) -> None:
    """One prompt's check (see `check_prompts`), errors naming `where`; `in_vocabulary` also refuses ids
    outside [0, vocab_size) (the serving engine checks before any forward).

    Raises:
        ValueError: not a non-empty list / tuple of Python ints, or an id out of range.
    """
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{where} must be a list of token ids, got {prompt!r:.80}")
    if not prompt:
        raise ValueError(f"{where} is empty: each prompt must be a non-empty list of token ids")
    lo, hi = (0, vocab_size) if in_vocabulary else INT64
    for pos, t in enumerate(prompt):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"{where}[{pos}] must be a Python int token id in [0, {vocab_size}) "
                             f"(config.vocab_size), got {t!r:.80}")
        if not lo <= t < hi:
            raise ValueError(outside_vocabulary(int(t), f"{where}[{pos}]", vocab_size))


def check_max_new_tokens(n, name: str = "max_new_tokens") -> int:
    """`n` as an int, or ValueError (naming `name`) unless it is an integer >= 1 (a bool is refused)."""
    if not (isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {n!r:.80}")
    return int(n)


def outside_vocabulary(token: int, where: str, vocab_size: int) -> str:
    """The message for a token id the embedding cannot look up (one wording for every entry)."""
    return (f"token id {token} ({where}) is outside the model's vocabulary: ids must lie in [0, {vocab_size}) "
            "(config.vocab_size)")


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
