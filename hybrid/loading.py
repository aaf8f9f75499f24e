"""From checkpoint files to a model: name mapping, dtype policy, strict accounting of every tensor.

Published names map one to one onto our modules, except the routed experts, which checkpoints store one
tensor per expert (`...mixer.experts.{j}.up_proj.weight [I, L]`) and we hold stacked
(`...mixer.experts.up_proj [E, I, L]`); an already stacked tensor under our name is accepted too.
Loading is strict (tests/test_cases.py, cases 10 and 11): a tensor the model needs and the files lack, a tensor in
the files the model does not use, or a shape that differs from the config's is an error naming it. With
`tie_word_embeddings` the head is the embedding matrix, and an `lm_head.weight` in the files must equal it.

Each tensor is read from a memory map and copied once, straight into its final dtype and device.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hybrid.checkpoint_files import CheckpointError, CheckpointFiles, resolve_checkpoint
from hybrid.config import HybridConfig
from hybrid.model import HybridForCausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<proj>up_proj|down_proj)$")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def parse_dtype(dtype: str | torch.dtype | None, config: HybridConfig) -> torch.dtype:
    """The compute dtype: an explicit `dtype` (bf16, fp16, fp32 or a torch dtype), else the config's.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype is None:
        return DTYPES[config.torch_dtype]
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_model(config: HybridConfig, dtype: torch.dtype, device: str | torch.device = "meta") -> HybridForCausalLM:
    """An uninitialised model in `dtype` (router and SSM parameters in fp32) on `device` (default: meta)."""
    with torch.device(device):
        model = HybridForCausalLM(config)
    return model.cast(dtype)


def load_model(
    path_or_repo: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> HybridForCausalLM:
    """Load a checkpoint directory (or hub repo id) into a `HybridForCausalLM` in eval mode.

    Args:
        path_or_repo: a local directory holding config.json and safetensors weights, or a hub repo id.
        dtype: compute dtype (`bf16`, `fp16`, `fp32`, or a torch dtype); default: the config's `torch_dtype`.
        device: where the weights go.
    Raises:
        ConfigError: config.json unreadable or invalid (names the file and field).
        CheckpointError: missing shard, missing / unused tensor, shape mismatch, quantized or pickled
            weights (names the file and tensor).
    """
    directory = resolve_checkpoint(path_or_repo, revision)
    config = HybridConfig.from_file(directory / "config.json")
    _refuse_quantized(directory, config)
    model = build_model(config, parse_dtype(dtype, config))
    load_weights(model, CheckpointFiles(directory), device)
    return model.eval()


def _refuse_quantized(directory: Path, config: HybridConfig) -> None:
    method = None
    if (directory / "hf_quant_config.json").exists():
        method = "modelopt (hf_quant_config.json)"
    elif config.quantization_config:
        method = str(config.quantization_config.get("quant_method", "unknown"))
    if method:
        raise CheckpointError(
            f"{directory}: quantized checkpoint ({method}); quantized weights are not supported by this version"
        )


def load_weights(model: HybridForCausalLM, files: CheckpointFiles, device: str | torch.device = "cpu") -> None:
    """Fill every parameter and buffer of `model` (built on meta) from `files`, strictly.

    Raises:
        CheckpointError: see the module docstring; the message names the tensor(s) and file(s).
    """
    config = model.config
    targets = model.state_dict(keep_vars=True)
    tied = config.tie_word_embeddings
    used: set[str] = set()
    missing: list[str] = []
    loaded: dict[str, torch.Tensor] = {}

    for name, target in targets.items():
        if tied and name == "lm_head.weight":
            continue
        sources = _source_names(name, target, files)
        if any(s not in files for s in sources):
            missing.extend(s for s in sources if s not in files)
            continue
        out = torch.empty(target.shape, dtype=target.dtype, device=device)
        if len(sources) == 1:
            _copy_checked(out, sources[0], files)
        else:
            for j, s in enumerate(sources):
                _copy_checked(out[j], s, files)
        used.update(sources)
        loaded[name] = out

    if tied:
        loaded["lm_head.weight"] = loaded.get("backbone.embeddings.weight")
        if "lm_head.weight" in files and "backbone.embeddings.weight" in loaded:
            used.add("lm_head.weight")
            head = files.view("lm_head.weight")
            if head.shape != loaded["backbone.embeddings.weight"].shape or not torch.equal(
                head.to(loaded["lm_head.weight"].dtype).to(device), loaded["lm_head.weight"]
            ):
                raise CheckpointError(
                    f"{files.file_of('lm_head.weight')}: config.json sets tie_word_embeddings, but lm_head.weight "
                    "differs from backbone.embeddings.weight"
                )
    if missing:
        raise CheckpointError(
            f"{files.directory}: {len(missing)} tensor(s) the config "
            f"(pattern {config.hybrid_override_pattern!r}) needs are missing: {_first(missing)}"
        )
    unused = sorted(set(files.keys()) - used)
    if unused:
        raise CheckpointError(
            f"{files.directory}: {len(unused)} tensor(s) in the files are not used by the model "
            f"(pattern {config.hybrid_override_pattern!r}): {_first(unused)}"
        )
    model.load_state_dict(loaded, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.backbone.embeddings.weight


def _source_names(name: str, target: torch.Tensor, files: CheckpointFiles) -> list[str]:
    """Checkpoint tensor names that make up model tensor `name` (several for stacked experts)."""
    m = _STACKED_EXPERTS.match(name)
    if m and name not in files:
        return [f"{m['prefix']}.{j}.{m['proj']}.weight" for j in range(target.shape[0])]
    return [name]


def _copy_checked(out: torch.Tensor, name: str, files: CheckpointFiles) -> None:
    shape = files.shape(name)
    if tuple(shape) != tuple(out.shape):
        raise CheckpointError(
            f"{files.file_of(name)}: tensor {name!r} has shape {list(shape)}; the config expects {list(out.shape)}"
        )
    if files.dtype(name) not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"{files.file_of(name)}: tensor {name!r} is {files.dtype(name)}, not a floating-point weight; "
            "quantized tensors need a quantization config"
        )
    out.copy_(files.view(name))


def _first(names: list[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" ... and {len(names) - n} more" if len(names) > n else "")


def load(
    path_or_repo: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
):
    """Load a model and its tokenizer: `(HybridForCausalLM, Tokenizer)`.

    The tokenizer's `stop_ids` are the union of config.json's, generation_config.json's and the
    tokenizer's eos ids. Raises what `load_model` and `Tokenizer.from_dir` raise.
    """
    from hybrid.tokenizer import Tokenizer

    directory = resolve_checkpoint(path_or_repo, revision)
    model = load_model(directory, dtype, device)
    tokenizer = Tokenizer.from_dir(directory, config_eos=model.config.eos_token_ids, config_pad=model.config.pad_token_id)
    return model, tokenizer
