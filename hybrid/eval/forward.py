"""Logits at chosen positions of long sequences, in bounded memory.

The batch is left-padded and run through one `HybridCache` in chunks of `chunk_size` tokens (the same
path as a chunked prefill), and only the chosen positions go through the LM head (`model.logits`), so
memory is bounded by the chunk, the constant Mamba state and the attention layers' KV cache; the
[T, vocab] logits of a whole long sequence are never held. Used for teacher-forced scoring (MQAR) and the
lm-evaluation-harness log-likelihoods.
"""

from __future__ import annotations

import torch

from hybrid.batch import left_pad
from hybrid.generate import PREFILL_CHUNK_SIZE


@torch.inference_mode()
def logits_at(model, sequences: list[list[int]], positions: list[list[int]], chunk_size: int = PREFILL_CHUNK_SIZE,
              pad_id: int = 0) -> list[torch.Tensor]:
    """Next-token logits at `positions[i]` of `sequences[i]`.

    Args:
        sequences: B non-empty token id lists (any lengths; left-padded internally, padding is masked).
        positions: per sequence, indexes t into it; the logits at t predict token t + 1.
    Returns:
        B float32 tensors [len(positions[i]), vocab], rows in the order of `positions[i]`.
    Raises:
        ValueError: empty input, a length mismatch, a position outside its sequence, or chunk_size < 1.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("sequences must be a non-empty list of non-empty token id lists")
    if len(positions) != len(sequences):
        raise ValueError(f"positions has {len(positions)} lists for {len(sequences)} sequences")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for i, (seq, pos) in enumerate(zip(sequences, positions)):
        if any(not 0 <= p < len(seq) for p in pos):
            raise ValueError(f"positions[{i}] must lie in [0, {len(seq)}), got {sorted(pos)[:3]}...{sorted(pos)[-3:]}")
    batch = left_pad(sequences, pad_id, model.device)
    ids, mask, offsets = batch.ids, batch.mask, batch.offsets
    B, L = ids.shape
    cache = model.new_cache(B, capacity=L)
    found: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]
    for s in range(0, L, chunk_size):
        h = model.hidden_states(ids[:, s:s + chunk_size], cache, attention_mask=mask[:, s:s + chunk_size])
        for row in range(B):
            local = sorted({offsets[row] + p - s for p in positions[row]} & set(range(h.shape[1])))
            if local:
                logits = model.logits(h[row, local])
                found[row].update({s + q - offsets[row]: logits[k] for k, q in enumerate(local)})
    vocab = model.config.vocab_size
    return [torch.stack([found[row][p] for p in positions[row]]) if positions[row] else torch.empty(0, vocab)
            for row in range(B)]
