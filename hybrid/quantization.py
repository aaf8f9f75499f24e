"""Quantization as one declared mechanism: a checkpoint's quantization config, read once, and the one place
where packed modules are swapped into a model and its quantization is declared.

`read_quant_config(directory, config)` finds the config (`hf_quant_config.json`, else config.json's
`quantization_config`, already parsed into `config`; `moe.quant.config`). `quantize_modules` then replaces,
by checkpoint module name,

    every nn.Linear the config quantizes        -> moe.quant.QuantLinear in that format
    every moe.experts.ExpertBank whose experts   -> moe.experts.QuantExpertBank; the format of projection p is
      `<bank>.{j}.up_proj / down_proj` are         the one declared for `<bank>.{j}.p`, which must be the
      quantized                                    same for every expert j (we hold them stacked)

either as empty packed modules for a checkpoint's tensors to fill (loading, `hybrid info`) or by quantizing
the float weights the modules hold (`hybrid.quantize`), and sets `model.quantization` / `model.act_quant`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybrid.checkpoint_files import CheckpointError, CheckpointFiles
from hybrid.config import HybridConfig
from hybrid.model import HybridForCausalLM
from moe.calibration import InputAmax
from moe.experts import ExpertBank, QuantExpertBank
from moe.quant import QuantFormat, QuantLinear, swap_modules
from moe.quant.config import QuantConfig, QuantConfigError

KV_SCALES = (("k_proj", "k_scale"), ("v_proj", "v_scale"))


def read_quant_config(directory: Path, config: HybridConfig) -> QuantConfig | None:
    """The checkpoint's quantization config, or None when it is not quantized. `config`: the checkpoint's
    parsed config.json (its `quantization_config` block is used as read, config.json is not read again).

    Raises:
        CheckpointError: an unknown method or algorithm or a malformed config (naming the file and key).
    """
    try:
        return QuantConfig.from_checkpoint(directory, config.quantization_config)
    except QuantConfigError as e:
        raise CheckpointError(f"quantized checkpoint: {e}") from None


def bank_format(qc: QuantConfig, name: str, proj: str, n_experts: int) -> QuantFormat | None:
    """The one format `qc` gives projection `proj` of every expert `name.{j}`.

    Raises:
        ValueError: the experts' formats differ.
    """
    fmts = {qc.format_for(f"{name}.{j}.{proj}") for j in range(n_experts)}
    if len(fmts) > 1:
        labels = sorted(f.label if f else "unquantized" for f in fmts)
        raise ValueError(f"{qc.source} gives the experts of {name} different formats for {proj} "
                         f"({', '.join(labels)}); experts of one bank must share a format")
    return fmts.pop()


def quantize_modules(model: HybridForCausalLM, qc: QuantConfig, act_quant: bool = False,
                     quantize_weights: bool = False, amax: InputAmax | None = None) -> int:
    """Swap the modules `qc` quantizes for packed ones (see the module docstring) and declare `qc` on the model.

    quantize_weights: False: empty packed modules, on the device of the ones they replace (usually meta),
        for a checkpoint's tensors to fill; True: quantize the float weights the modules hold, with the
        calibrated input statistics `amax` for static input scales (none: every input scale is 1.0).
    act_quant: the packed modules quantize-dequantize their inputs (W8A8 / W4A4 emulation).
    Returns the number of modules swapped.
    Raises:
        ValueError: a quantized head tied to the embeddings, a weight the format cannot store, or experts of
            one bank in different formats (the message names the config and the module).
    """
    tied = model.config.tie_word_embeddings
    amax = amax or InputAmax()

    def packed(name: str, module: nn.Module) -> nn.Module | None:
        if isinstance(module, nn.Linear):
            fmt = qc.format_for(name, "Linear")
            if fmt is None:
                return None
            if tied and name == "lm_head":
                raise ValueError(f"{qc.source} quantizes lm_head, which is tied to the embeddings "
                                 "(tie_word_embeddings); keep it unquantized")
            try:
                fmt.check_shape(module.out_features, module.in_features, name)
            except ValueError as e:
                raise ValueError(f"{qc.source}: {e}") from None
            if quantize_weights:
                return QuantLinear.from_linear(module, fmt, amax.linear.get(name, torch.tensor(0.0)), act_quant)
            w = module.weight
            return QuantLinear(fmt, module.in_features, module.out_features, module.bias is not None, w.dtype,
                               act_quant, w.device)
        if isinstance(module, ExpertBank):
            E, I, L = module.up_proj.shape
            up, down = bank_format(qc, name, "up_proj", E), bank_format(qc, name, "down_proj", E)
            if up is None and down is None:
                return None
            try:
                if quantize_weights:
                    up_amax, down_amax = amax.experts.get(name, (torch.zeros(E), torch.zeros(E)))
                    return QuantExpertBank.from_bank(module, up, down, up_amax, down_amax, act_quant)
                return QuantExpertBank(E, L, I, up, down, module.up_proj.dtype, act_quant, module.up_proj.device)
            except ValueError as e:
                raise ValueError(f"{qc.source}: {name}: {e}") from None
        return None

    swapped = swap_modules(model, packed)
    model.quantization, model.act_quant = qc, act_quant
    model.reset_identity()
    return swapped


def register_kv_scales(model: nn.Module, qc: QuantConfig, files: CheckpointFiles) -> None:
    """Register the KV-cache scales the files hold (`<attention>.k_proj.k_scale`, `.v_proj.v_scale`) as fp32
    buffers (on meta, for the loader to fill) when the config declares a KV-cache algorithm; the KV cache
    itself stays in the model dtype."""
    if not qc.kv_cache:
        return
    for name, module in list(model.named_modules()):
        for proj, scale in KV_SCALES:
            key = f"{name}.{proj}.{scale}"
            child = getattr(module, proj, None)
            if isinstance(child, nn.Module) and key in files:
                child.register_buffer(scale, torch.empty(files.shape(key), dtype=torch.float32, device="meta"))
