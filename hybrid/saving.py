"""Write a model as a published-style checkpoint: config.json (NVIDIA dialect) and safetensors weights.

Tensor names are the published ones (`backbone.` prefix, one tensor per routed expert,
`e_score_correction_bias` in fp32), so transformers' `NemotronHForCausalLM` and vLLM-style loaders read
the result. A quantized model (`model.quantization`, from loading a quantized checkpoint or from
`hybrid.quantize`) is written with its packed tensors as they are and its quantization config files
(`hf_quant_config.json` and/or config.json's `quantization_config`). Writing goes through
`hybrid.checkpoint_writer` (never onto the source, never over a non-empty directory unless asked, into a
temporary directory renamed at the end; with `max_shard_bytes`, `model-0000i-of-0000n.safetensors` shards
plus `model.safetensors.index.json`); tensors are produced one module at a time, so a prepacked model's
dense copies never all exist at once.

A quantized model's checkpoint also says what was changed in its model card: the source's README.md (or a
new one) ends with a "Quantization" section naming the format, the excluded modules, the tool and the
source (`model_card`); the source's other files are copied byte for byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from hybrid.checkpoint_writer import CheckpointWriter
from hybrid.config import HybridConfig
from hybrid.dtypes import dtype_name
from hybrid.loading import STACKED_EXPERTS
from hybrid.model import HybridForCausalLM
from moe.quant.config import HF_QUANT_CONFIG, QuantConfig


def published_tensors(model: HybridForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors under their published names, one at a time: experts unstacked (a bank held one expert at a
    time is read that way, never stacked), a tied head omitted."""
    for name, shape, _, pieces in model.weight_pieces():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = STACKED_EXPERTS.match(name)
        if not m:
            (t,) = pieces  # one piece: the tensor
            yield name, t.detach()
            continue
        experts = (t for piece in pieces for t in (piece if piece.dim() == len(shape) else (piece,)))
        for j, t in enumerate(experts):  # a piece is the whole stack or one expert
            yield f"{m['prefix']}.{j}.{m['proj']}{m['tensor'] or '.weight'}", t.detach()


def published_state_dict(model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """`published_tensors` as one dict of contiguous CPU copies."""
    return {name: t.cpu().contiguous() for name, t in published_tensors(model)}


def save_checkpoint(model: HybridForCausalLM, directory: str | Path, max_shard_bytes: int | None = None,
                    source: str | Path | None = None, overwrite: bool = False,
                    files: dict[str, str] | None = None) -> Path:
    """Write config.json, generation_config.json and the weights of `model` into `directory`; returns it.

    source: the checkpoint the model came from: its other files (tokenizer, chat template, model card,
        generation_config.json with its sampling defaults) are copied, and `directory` may not be it, be
        inside it or contain it. Default: the directory `hybrid.load_model` loaded the model from
        (`model.source_dir`, while it exists), so a loaded model keeps its tokenizer files and is never
        saved onto its own checkpoint.
    files: more text files to write with it ({name: text}: tokenizer files, a training log), in the same
        all-or-nothing write.
    Raises:
        hybrid.checkpoint_writer.WriteError: `directory` is not empty (without `overwrite`), clashes with
            `source` (the model's own checkpoint by default: "is the source") or cannot be created.
        OSError: a write failed (`directory` is then as it was).
    """
    if source is None:  # a loaded model: where it came from
        loaded_from = getattr(model, "source_dir", None)
        source = loaded_from if loaded_from is not None and Path(loaded_from).is_dir() else None
    with CheckpointWriter(directory, source=source, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        write_config_files(writer, model.config, model.dtype, model.quantization, source)
        for name, text in (files or {}).items():
            writer.write_text(name, text)
        for name, t in published_tensors(model):
            writer.add(name, t)
    return Path(directory)


def write_config_files(writer: CheckpointWriter, config: HybridConfig, dtype: torch.dtype,
                       quantization: QuantConfig | None, source: str | Path | None,
                       source_name: str | None = None) -> None:
    """config.json (NVIDIA dialect, `torch_dtype` = `dtype`, the quantization block), hf_quant_config.json
    when the quantization has one, generation_config.json unless the source has its own (then copied), and
    for a quantized model the model card (`model_card`; `source_name`: how it names the source, e.g. a hub
    repo id; default the source's absolute path)."""
    config = dataclasses.replace(config, torch_dtype=dtype_name(dtype))
    if quantization is not None:
        config = dataclasses.replace(config, quantization_config=quantization.files.get("config.json"))
        if HF_QUANT_CONFIG in quantization.files:
            writer.write_json(HF_QUANT_CONFIG, quantization.files[HF_QUANT_CONFIG])
    writer.write_json("config.json", config.to_dict())
    if source is None or not (Path(source) / "generation_config.json").is_file():
        writer.write_json("generation_config.json", {"bos_token_id": config.bos_token_id,
                                                     "eos_token_id": config.eos_token_id,
                                                     "pad_token_id": config.pad_token_id})
    if quantization is not None:
        card = Path(source) / "README.md" if source is not None else None
        old = card.read_text() if card is not None and card.is_file() else ""
        name = source_name or (str(Path(source).resolve()) if source is not None else None)
        writer.write_text("README.md", model_card(old, quantization, dtype, name))


CARD_HEADING = "## Quantization (hybrid-moe)"


def model_card(card: str, quantization: QuantConfig, dtype: torch.dtype, source: str | None) -> str:
    """`card` (a model card's text, possibly empty) with a section saying how the weights were quantized.
    A card that has the section already (a quantized checkpoint saved again) is returned as it is."""
    if card.startswith(f"{CARD_HEADING}\n") or f"\n{CARD_HEADING}\n" in card:
        return card
    try:
        tool = f"hybrid-moe {version('hybrid-moe')}"
    except PackageNotFoundError:
        tool = "hybrid-moe"
    if card and not card.endswith("\n"):
        card += "\n"
    excluded = ", ".join(f"`{p}`" for p in quantization.exclude) or "none"
    section = (f"{CARD_HEADING}\n\n"
               f"Derived from the source below by quantizing its weights; the tokenizer, chat template and "
               f"generation config are the source's.\n\n"
               f"- format: {', '.join(sorted(quantization.labels()))} ({quantization.method}; see "
               f"`config.json` `quantization_config`)\n"
               f"- excluded modules (kept in {dtype_name(dtype)}): {excluded}\n"
               f"- tool: {tool} (`hybrid quantize`)\n"
               f"- source: {source or 'not recorded'}\n")
    return card + ("\n" if card else "") + section
