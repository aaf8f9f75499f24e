"""Quantize a float model to FP8, NVFP4 or MXFP4 and write it in ModelOpt's checkpoint layout.

    model = quantize_model(model, "nvfp4", exclude=None, calibration=[ids, ...])     # in place
    save_checkpoint(model, "out/")          # hf_quant_config.json + config.json `quantization_config`

Formats (ModelOpt `quant_algo`): fp8 = FP8 (per-tensor E4M3 weight scale, static input scale), nvfp4 =
NVFP4 (E2M1 in blocks of 16, E4M3 block scales, fp32 global scale, static input scale), mxfp4 = MXFP4
(E2M1 in blocks of 32, E8M0 scales; no input scale). Static input scales are `amax / 448` (FP8) and
`amax / (6 * 448)` (NVFP4) of each module's inputs over the calibration batches (ModelOpt's max
calibration); an expert that no calibration token reached gets the largest amax of its bank, as
ModelOpt's export does for uncalibrated experts.

Default exclusions (`default_exclusions`) follow the Nemotron 3 Nano NVFP4 release: lm_head, the
embeddings, every attention layer's projections, the in/out projections of the Mamba layer feeding each
attention layer, every conv1d, the routers (`mixer.gate`), and the MTP block. `exclude` replaces them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch
from torch import nn

from hybrid.config import ATTENTION, MAMBA, HybridConfig
from hybrid.model import HybridForCausalLM
from hybrid.quantization import quantize_modules
from moe.calibration import InputAmax
from moe.experts import ExpertBank
from moe.prepack import unpack
from moe.quant import formats
from moe.quant.config import HF_QUANT_CONFIG, QuantConfig, modelopt_config_files


def default_exclusions(config: HybridConfig) -> list[str]:
    """ModelOpt `exclude_modules` wildcards of the Nano NVFP4 recipe for this layer pattern."""
    out = ["lm_head", "backbone.embeddings", "*.conv1d", "*.mixer.gate", "mtp*"]
    pattern = config.hybrid_override_pattern
    for i, kind in enumerate(pattern):
        if kind != ATTENTION:
            continue
        out.append(f"backbone.layers.{i}.mixer.*")
        feeding = max((j for j in range(i) if pattern[j] == MAMBA), default=None)
        if feeding is not None:
            out += [f"backbone.layers.{feeding}.mixer.in_proj", f"backbone.layers.{feeding}.mixer.out_proj"]
    return sorted(set(out), key=out.index)


def plan(config: HybridConfig, fmt_name: str, exclude: list[str] | None = None) -> QuantConfig:
    """The `QuantConfig` (with its files) of quantizing `config`'s model to `fmt_name` (a key of
    `moe.quant.formats.QUANTIZE_FORMATS`: fp8, nvfp4, mxfp4, or a registered one).

    Raises:
        ValueError: an unknown format name.
    """
    if fmt_name not in formats.QUANTIZE_FORMATS:
        raise ValueError(f"--format {fmt_name!r} is not supported; expected one of {sorted(formats.QUANTIZE_FORMATS)}")
    exclude = default_exclusions(config) if exclude is None else list(exclude)
    try:
        producer = {"name": "hybrid-moe", "version": version("hybrid-moe")}
    except PackageNotFoundError:
        producer = {"name": "hybrid-moe", "version": "unknown"}
    hf_quant, block = modelopt_config_files(formats.QUANTIZE_FORMATS[fmt_name], exclude, producer)
    qc = QuantConfig.from_modelopt(hf_quant, HF_QUANT_CONFIG)
    qc.files["config.json"] = block
    return qc


def has_static_inputs(fmt_name: str) -> bool:
    """Whether `quantize_model(..., fmt_name)` writes static input scales (so calibration text matters)."""
    return formats.MODELOPT_ALGOS[formats.QUANTIZE_FORMATS[fmt_name]].layout.input_scale


@torch.no_grad()
def calibrate(model: nn.Module, qc: QuantConfig, batches: list[torch.Tensor]) -> InputAmax:
    """Run `batches` ([1, T] int64 each) through `model`, recording (by forward pre-hooks) the input amax of
    every Linear `qc` quantizes and of every expert bank."""
    stats = InputAmax()
    handles = [stats.attach(name, module) for name, module in model.named_modules()
               if (isinstance(module, nn.Linear) and qc.format_for(name) is not None) or isinstance(module, ExpertBank)]
    try:
        for ids in batches:
            model(ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    stats.fill_unreached()
    return stats


@torch.no_grad()
def quantize_model(model: HybridForCausalLM, fmt_name: str, exclude: list[str] | None = None,
                   calibration: list[torch.Tensor] | None = None) -> HybridForCausalLM:
    """Quantize `model` (a float `HybridForCausalLM`) in place; returns it, with `model.quantization` set so
    that `save_checkpoint` writes the ModelOpt layout. `calibration`: token batches for the static input
    scales (FP8, NVFP4); without them, every input scale is 1.0.

    Raises:
        ValueError: the model is already quantized, an unknown format, or a module the format cannot store.
    """
    if model.quantization is not None:
        raise ValueError("the model is already quantized")
    unpack(model)  # a model loaded for CPU inference holds prepacked weights: back to plain modules
    qc = plan(model.config, fmt_name, exclude)
    stats = calibrate(model, qc, calibration) if calibration else None
    quantize_modules(model, qc, quantize_weights=True, amax=stats)
    return model
