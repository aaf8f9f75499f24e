"""Write a model as a published-style checkpoint: config.json (NVIDIA dialect) and safetensors weights.

Tensor names are the published ones (`backbone.` prefix, one tensor per routed expert,
`e_score_correction_bias` in fp32), so transformers' `NemotronHForCausalLM` and vLLM-style loaders read
the result. A quantized model (`model.quantization`, from loading a quantized checkpoint or from
`hybrid.quantize`) is written with its packed tensors as they are and its quantization config files
(`hf_quant_config.json` and/or config.json's `quantization_config`). With `max_shard_bytes`, weights are split into `model-0000i-of-0000n.safetensors` shards plus
`model.safetensors.index.json`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybrid.checkpoint_files import INDEX_NAME, SINGLE_NAME
from hybrid.dtypes import dtype_name
from hybrid.loading import STACKED_EXPERTS
from hybrid.model import HybridForCausalLM
from moe.quant.config import HF_QUANT_CONFIG


def published_state_dict(model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """Our tensors under their published names: experts unstacked, a tied head omitted (contiguous CPU copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = t.detach().cpu()
        m = STACKED_EXPERTS.match(name)
        if m:
            for j in range(t.shape[0]):
                out[f"{m['prefix']}.{j}.{m['proj']}{m['tensor'] or '.weight'}"] = t[j].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_checkpoint(model: HybridForCausalLM, directory: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write config.json, generation_config.json and the weights of `model` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config, torch_dtype=dtype_name(model.dtype))
    quant = model.quantization
    if quant is not None:
        config = dataclasses.replace(config, quantization_config=quant.files.get("config.json"))
        if HF_QUANT_CONFIG in quant.files:
            (directory / HF_QUANT_CONFIG).write_text(json.dumps(quant.files[HF_QUANT_CONFIG], indent=4) + "\n")
    config.save(directory / "config.json")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tensors = published_state_dict(model)
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, directory / SINGLE_NAME, metadata=metadata)
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.nelement() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.nelement() * t.element_size() for t in tensors.values())
    (directory / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return directory
