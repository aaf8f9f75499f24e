"""Quantized checkpoints: read the quantization config, swap the affected modules of a (meta) model.

`read_quant_config` finds the config (`hf_quant_config.json`, else config.json's `quantization_config`,
parsed by `moe.quant.config`). `apply_quant_config` then replaces, by checkpoint module name:

    every nn.Linear the config quantizes        -> moe.quant.QuantLinear in that format
    every moe.experts.ExpertBank whose experts   -> moe.quant.QuantExpertBank; the format of projection p is
      `<bank>.{j}.up_proj / down_proj` are         the one declared for `<bank>.{j}.p`, which must be the
      quantized                                    same for every expert j (we hold them stacked)

and registers the KV-cache scales (`<attention>.k_proj.k_scale`, `.v_proj.v_scale`) as fp32 buffers when
the config declares a KV-cache algorithm and the files hold them. The strict loader
(`hybrid.loading.load_weights`) then fills every tensor name for name; a tensor whose dtype or shape is
not the declared format's is an error naming the tensor, the module, the format and the config file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hybrid.checkpoint_files import CheckpointError, CheckpointFiles
from moe.experts import ExpertBank
from moe.quant.config import QuantConfig, QuantConfigError
from moe.quant.experts import QuantExpertBank
from moe.quant.linear import QuantLinear

KV_SCALES = (("k_proj", "k_scale"), ("v_proj", "v_scale"))


def read_quant_config(directory: Path) -> QuantConfig | None:
    """The checkpoint's quantization config, or None when it is not quantized. Raises CheckpointError
    (naming the file and key) for an unknown method or algorithm or a malformed config."""
    config_path = directory / "config.json"
    try:
        raw = json.loads(config_path.read_text()) if config_path.exists() else {}
        return QuantConfig.from_checkpoint(directory, raw if isinstance(raw, dict) else {})
    except QuantConfigError as e:
        raise CheckpointError(f"quantized checkpoint: {e}") from None
    except json.JSONDecodeError:
        return None  # config.json itself is reported by HybridConfig.from_file


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path `name`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def bank_format(qc: QuantConfig, name: str, proj: str, n_experts: int):
    """The one format `qc` gives projection `proj` of every expert `name.{j}` (CheckpointError if they differ)."""
    fmts = {qc.format_for(f"{name}.{j}.{proj}") for j in range(n_experts)}
    if len(fmts) > 1:
        labels = sorted(f.label if f else "unquantized" for f in fmts)
        raise CheckpointError(f"quantized checkpoint: {qc.source} gives the experts of {name} different formats for "
                              f"{proj} ({', '.join(labels)}); experts of one bank must share a format")
    return fmts.pop()


def apply_quant_config(model: nn.Module, qc: QuantConfig, files: CheckpointFiles | None = None,
                       act_quant: bool = False) -> None:
    """Swap `model`'s modules for packed ones as `qc` declares (see the module docstring). `model` is usually
    on the meta device; the new modules are created on the device of the ones they replace."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            fmt = qc.format_for(name, "Linear")
            if fmt is None:
                continue
            if tied and name == "lm_head":
                raise CheckpointError(f"quantized checkpoint: {qc.source} quantizes lm_head, which is tied to the "
                                      "embeddings (tie_word_embeddings); keep it unquantized")
            try:
                fmt.check_shape(module.out_features, module.in_features, name)
            except ValueError as e:
                raise CheckpointError(f"quantized checkpoint: {qc.source}: {e}") from None
            w = module.weight
            set_module(model, name, QuantLinear(fmt, module.in_features, module.out_features,
                                                 module.bias is not None, w.dtype, act_quant, w.device))
        elif isinstance(module, ExpertBank):
            E, I, L = module.up_proj.shape
            up, down = bank_format(qc, name, "up_proj", E), bank_format(qc, name, "down_proj", E)
            if up is None and down is None:
                continue
            try:
                bank = QuantExpertBank(E, L, I, up, down, module.up_proj.dtype, act_quant, module.up_proj.device)
            except ValueError as e:
                raise CheckpointError(f"quantized checkpoint: {qc.source}: {name}: {e}") from None
            set_module(model, name, bank)
    if qc.kv_cache and files is not None:
        for name, module in list(model.named_modules()):
            for proj, scale in KV_SCALES:
                key = f"{name}.{proj}.{scale}"
                child = getattr(module, proj, None)
                if isinstance(child, nn.Module) and key in files:
                    child.register_buffer(scale, torch.empty(files.shape(key), dtype=torch.float32, device="meta"))
    model.quantization = qc


def packed_owner(model: nn.Module) -> dict[str, tuple[str, object]]:
    """{state-dict name: (module name, QuantFormat)} of every tensor held by a packed module."""
    owners = {}
    for name, module in model.named_modules():
        fmt = getattr(module, "fmt", None)
        if fmt is None or not getattr(module, "keeps_dtypes", False):
            continue
        for tname in module._buffers:
            owners[f"{name}.{tname}"] = (name, fmt)
    return owners


def mismatch_message(files: CheckpointFiles, source: str, model_name: str, module: str, fmt, want_shape,
                     want_dtype, qc: QuantConfig | None) -> str:
    """Why file tensor `source` cannot fill a packed module's tensor (names the config that declared it)."""
    where = qc.source if qc is not None else "the quantization config"
    return (f"{files.file_of(source)}: quantized checkpoint: tensor {source!r} is {files.dtype(source)} "
            f"{list(files.shape(source))}, but {where} declares module {module!r} {fmt.label}, which stores "
            f"{model_name.rpartition('.')[2]!r} as {want_dtype} {list(want_shape)}")
