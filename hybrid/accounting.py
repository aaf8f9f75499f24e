"""What a configuration costs: parameters (total and active per token), bytes per dtype, cache sizes.

Computed on a model built on the meta device, so a `config.json` alone is enough (no weights).
"Active" counts every weight a token's forward reads: everything except the routed experts, plus
`num_experts_per_tok` of them per MoE layer; the embedding table is reported apart, since a token reads
one row of it. The MTP block (if any) is counted apart and left out of the totals.
"""

from __future__ import annotations

from collections import Counter

import torch

from hybrid.config import ATTENTION, LAYER_CHARS, MAMBA, HybridConfig
from hybrid.loading import build_model

_KIND_NAMES = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}


def describe(config: HybridConfig, dtype: torch.dtype) -> dict:
    """A JSON-ready summary of `config` when loaded in `dtype` (see the module docstring)."""
    model = build_model(config, dtype, device="meta")
    total = active = embedding = mtp = 0
    nbytes: Counter[str] = Counter()
    seen: set[int] = set()
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel()
        nbytes[str(t.dtype).removeprefix("torch.")] += n * t.element_size()
        if name.startswith("mtp."):
            mtp += n
            continue
        total += n
        if name == "backbone.embeddings.weight":
            embedding += n
            if config.tie_word_embeddings:  # the same matrix is read in full by the head
                active += n
        elif ".mixer.experts." in name:
            active += n * k_over_e
        else:
            active += n
    item = torch.empty((), dtype=dtype).element_size()
    ssm_item = torch.empty((), dtype=getattr(torch, config.mamba_ssm_cache_dtype)).element_size()
    n_attn = len(config.layer_indices(ATTENTION))
    n_mamba = len(config.layer_indices(MAMBA))
    kv_per_token = n_attn * 2 * config.num_key_value_heads * config.head_dim * item
    conv_bytes = config.conv_dim * (config.conv_kernel - 1) * item
    ssm_bytes = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * ssm_item
    return {
        "pattern": config.hybrid_override_pattern,
        "layers": {_KIND_NAMES[k]: config.hybrid_override_pattern.count(k) for k in LAYER_CHARS},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": total,
        "active_parameters_per_token": round(active),
        "embedding_parameters": embedding,
        "bytes_by_dtype": dict(sorted(nbytes.items())),
        "weight_bytes": sum(nbytes.values()),
        "kv_cache_bytes_per_token": kv_per_token,
        "mamba_state_bytes_per_sequence": n_mamba * (conv_bytes + ssm_bytes),
        "mtp": {"layers": config.mtp_pattern, "parameters": mtp} if config.num_nextn_predict_layers else None,
    }
