"""Logits at chosen positions of long sequences, in bounded memory.

The sequences run as packed sequences over the engine's paged cache (`hybrid.serving.paged_cache.PagedCache`:
each its own KV blocks and state slot, no padding), in chunks of `chunk_size` tokens each (the same path as a
chunked prefill), and only the chosen positions go through the LM head (`model.logits`), so memory is bounded by
the chunks, the constant Mamba states and the attention layers' keys and values; the [T, vocab] logits of a whole
long sequence are never held. Used for teacher-forced scoring (MQAR) and the lm-evaluation-harness
log-likelihoods.
"""

from __future__ import annotations

import torch

from hybrid.generate import PREFILL_CHUNK_SIZE
from hybrid.serving.blocks import BlockPool
from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE
from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
from hybrid.serving.slots import StateSlots


@torch.inference_mode()
def logits_at(model, sequences: list[list[int]], positions: list[list[int]], chunk_size: int = PREFILL_CHUNK_SIZE,
              pad_id: int = 0) -> list[torch.Tensor]:
    """Next-token logits at `positions[i]` of `sequences[i]`.

    Args:
        sequences: B non-empty token id lists (any lengths: each runs as its own packed sequence).
        positions: per sequence, indexes t into it; the logits at t predict token t + 1.
        pad_id: unused (nothing is padded); kept for callers of the padded batch this once was.
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
    config, bs = model.cache_config, DEFAULT_BLOCK_SIZE
    blocks = BlockPool(config, sum(-(-len(s) // bs) for s in sequences), bs, model.dtype, model.device)
    slots = StateSlots(config, len(sequences), model.dtype, model.device)
    rows = [([blocks.allocate() for _ in range(-(-len(s) // bs))], slots.allocate()) for s in sequences]
    cache = PagedCache(config, blocks, slots)
    wanted = [set(p) for p in positions]
    found: list[dict[int, torch.Tensor]] = [{} for _ in sequences]
    for start in range(0, max(len(s) for s in sequences), chunk_size):
        active = [i for i, s in enumerate(sequences) if len(s) > start]
        ends = [min(start + chunk_size, len(sequences[i])) for i in active]
        cache.schedule([ScheduledSeq(*rows[i], start, end - start) for i, end in zip(active, ends)])
        ids = [t for i, end in zip(active, ends) for t in sequences[i][start:end]]
        h = model.hidden_states(torch.tensor([ids], device=model.device), cache)[0]
        offset = 0
        for i, end in zip(active, ends):
            local = sorted(wanted[i] & set(range(start, end)))
            if local:
                logits = model.logits(h[[offset + p - start for p in local]])
                found[i].update({p: logits[k] for k, p in enumerate(local)})
            offset += end - start
    vocab = model.config.vocab_size
    return [torch.stack([found[i][p] for p in positions[i]]) if positions[i] else torch.empty(0, vocab)
            for i in range(len(sequences))]
