"""What a configuration costs: parameters (total and active per token), bytes per dtype, cache sizes.

Computed on a model built on the meta device, so a `config.json` alone is enough (no weights).
With a quantization config (a quantized checkpoint's, or a planned one: `hybrid info --format nvfp4`),
the affected modules are swapped for packed ones first, so bytes are the packed sizes and
`bytes_by_format` splits them by storage format (a packed weight's scales count with its format).
"Active" counts every weight a token's forward reads: everything except the routed experts, plus
`num_experts_per_tok` of them per MoE layer; the embedding table is reported apart, since a token reads
one row of it (which `active_weight_bytes_per_token`, the bytes a decode step reads in the stored
formats, counts). The MTP block (if any) is counted apart and left out of the totals. `storage` names what
the weights are stored in: the dtype, or the packed formats and the dtype of the rest ("FP8 + bfloat16 rest").
"""

from __future__ import annotations

from collections import Counter

import torch

from hybrid.config import ATTENTION, LAYER_CHARS, MAMBA, HybridConfig
from hybrid.dtypes import dtype_name, torch_dtype
from hybrid.loading import build_model
from hybrid.quantization import quantize_modules
from moe.quant import PackedWeight
from moe.quant.config import QuantConfig

_KIND_NAMES = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}


def _packed(model) -> dict[str, tuple[str, int]]:
    """{tensor name: (format label, parameters it stands for)} of the tensors held by packed modules: the
    data tensor stands for the whole [E?, out, in] weight, the scales for none."""
    out = {}
    for mname, module in model.named_modules():
        if isinstance(module, PackedWeight):
            data = module.fmt.names["data"]
            out.update({f"{mname}.{b}": (module.fmt.label, module.numel if b == data else 0)
                        for b, _ in module.named_buffers(recurse=False)})
    return out


def describe(config: HybridConfig, dtype: torch.dtype, quant: QuantConfig | None = None) -> dict:
    """A JSON-ready summary of `config` when loaded in `dtype` (see the module docstring).

    quant: a `moe.quant.config.QuantConfig` to apply (packed sizes), or None.
    Raises:
        ValueError: `quant` cannot apply to this config (the message names the config and module).
    """
    model = build_model(config, dtype, device="meta")
    if quant is not None:
        quantize_modules(model, quant)
    packed = _packed(model)
    total = active = embedding = mtp = active_bytes = 0
    nbytes: Counter[str] = Counter()
    by_format: Counter[str] = Counter()
    seen: set[int] = set()
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        b = t.numel() * t.element_size()
        name_of_dtype = dtype_name(t.dtype)
        label, n = packed.get(name, (name_of_dtype, t.numel()))
        nbytes[name_of_dtype] += b
        by_format[label] += b
        if name.startswith("mtp."):
            mtp += n
            continue
        total += n
        if name == "backbone.embeddings.weight":
            embedding += n
            active_bytes += b if config.tie_word_embeddings else b // config.vocab_size  # one row, or the head
            if config.tie_word_embeddings:  # the same matrix is read in full by the head
                active += n
        elif ".mixer.experts." in name:
            active += n * k_over_e
            active_bytes += b * k_over_e
        else:
            active += n
            active_bytes += b
    item = torch.empty((), dtype=dtype).element_size()
    return {
        "pattern": config.hybrid_override_pattern,
        "layers": {_KIND_NAMES[k]: config.hybrid_override_pattern.count(k) for k in LAYER_CHARS},
        "dtype": dtype_name(dtype),
        "parameters": total,
        "active_parameters_per_token": round(active),
        "active_weight_bytes_per_token": round(active_bytes),
        "embedding_parameters": embedding,
        "bytes_by_dtype": dict(sorted(nbytes.items())),
        "bytes_by_format": dict(sorted(by_format.items())),
        "storage": " + ".join(sorted({label for label, _ in packed.values()}) + [f"{dtype_name(dtype)} rest"])
                   if packed else dtype_name(dtype),
        "quantization": None if quant is None else {"method": quant.method, "source": quant.source,
                                                    "formats": sorted(quant.labels()), "kv_cache": quant.kv_cache},
        "weight_bytes": sum(nbytes.values()),
        "kv_cache_bytes_per_token": _kv_per_token(config, item),
        "mamba_state_bytes_per_sequence": _mamba_state(config, item),
        "mtp": {"layers": config.mtp_pattern, "parameters": mtp} if config.num_nextn_predict_layers else None,
    }


def describe_ranks(config: HybridConfig, dtype: torch.dtype, world: int, quant: QuantConfig | None = None) -> dict:
    """What each of `world` tensor-parallel ranks holds (`hybrid.parallel`), from the config alone: per rank,
    its weight bytes (the rank's modules built on meta, packed as `quant` says; the MTP block included), KV
    cache bytes per token and Mamba state bytes per sequence; and the collectives of one decoded token (calls
    and payload bytes per rank by kind, `ShardPlan.traffic`) with what a ring sends from each rank.

    Raises:
        ConfigError: the config does not split `world` ways (`ShardPlan`, naming the fields).
        ValueError: `quant` cannot apply to this config.
    """
    from hybrid.loading import build_rank_model
    from hybrid.parallel import ShardPlan, ring_bytes

    full = build_model(config, dtype, device="meta")
    if quant is not None:
        quantize_modules(full, quant)
    item = torch.empty((), dtype=dtype).element_size()
    ranks, plan = [], None
    for rank in range(world):
        plan = ShardPlan(config, rank, world, quant)
        model, _, subsets = build_rank_model(full, plan, quant)
        tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        local = plan.local_config
        ranks.append({
            "rank": rank,
            "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "kv_cache_bytes_per_token": _kv_per_token(local, item),
            "mamba_state_bytes_per_sequence": _mamba_state(local, item),
            "experts_per_moe_layer": plan.experts[1] - plan.experts[0],
            "vocab_rows": plan.vocab[1] - plan.vocab[0],
            "packed_modules_with_extra_rows": len(subsets),
        })
    traffic = plan.traffic(tokens=1, dtype_bytes=item)
    return {"tensor_parallel": world, "dtype": dtype_name(dtype), "ranks": ranks,
            "collectives_per_token": traffic,
            "ring_bytes_sent_per_token": round(ring_bytes(traffic["payload"]["all_reduce"],
                                                          traffic["payload"]["all_gather"], world))}


def _kv_per_token(config: HybridConfig, item: int) -> int:
    return len(config.layer_indices(ATTENTION)) * 2 * config.num_key_value_heads * config.head_dim * item


def _mamba_state(config: HybridConfig, item: int) -> int:
    conv = config.conv_dim * (config.conv_kernel - 1) * item
    ssm = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * \
        torch_dtype(config.mamba_ssm_cache_dtype).itemsize
    return len(config.layer_indices(MAMBA)) * (conv + ssm)


def resident_bytes(model) -> int:
    """Bytes of the distinct tensor storages a loaded model holds: parameters, buffers, and any tensor kept
    as a plain module attribute or in a list attribute (so a cached dequantized weight, the oneDNN-packed
    weights of `moe.quant.kernels.prepacked`, counted as their logical size, and the per-expert tensors of
    `moe.quant.PackedExperts` are counted too)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                tensors.append(v)
            elif isinstance(v, list):  # a list of tensors, or of {name: tensor} (moe.quant.PackedExperts)
                tensors += [t for item in v for t in (item.values() if isinstance(item, dict) else (item,))
                            if isinstance(t, torch.Tensor)]
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total
