"""From checkpoint files to a model: name mapping, dtype policy, strict accounting of every tensor.

Published names map one to one onto our modules, except the routed experts, which checkpoints store one
tensor per expert (`...mixer.experts.{j}.up_proj.weight [I, L]`) and we hold stacked
(`...mixer.experts.up_proj [E, I, L]`); an already stacked tensor under our name is accepted too.
Quantized checkpoints (FP8, NVFP4, MXFP4 in ModelOpt, compressed-tensors or gpt-oss layout) are read
through `hybrid.quantization`: the model is built on meta, the affected Linears and expert banks are
swapped for packed modules, and their tensors (`weight`, `weight_scale`, ..., per expert
`...experts.{j}.up_proj.weight_scale` stacked into `...experts.up_proj.weight_scale`) load name for name,
kept in their stored dtypes. On the CPU a packed expert stack is held one expert at a time
(`moe.quant.PackedExperts`): its tensors stay views of the read-only map, never stacked or copied.
Loading is strict (tests/test_cases.py, cases 10 and 11): a tensor the model needs and the files lack, a tensor in
the files the model does not use, or a shape that differs from the config's is an error naming it. With
`tie_word_embeddings` the head is the embedding matrix, and an `lm_head.weight` in the files must equal it.

Each tensor is read from a memory map and copied once, straight into its final dtype and device; its pages
of the map are then dropped from the process (`CheckpointFiles.release`), so loading holds one copy. The
model's identity (`HybridForCausalLM.identity`) is taken on first use, from the loaded tensors. A bf16 model on a CPU
with bf16 kernels (`moe.quant.kernels.bf16`) is prepacked for inference as it is read (`moe.prepack`);
where that is the plain form, its bf16 matrices are not copied at all but stay views of the read-only map
(loading then touches no weight bytes: docs/perf-log.md#bf16-mmap-views), read from the page cache by the
first forward. Such an inference-only load (prepacked or mapped weights) maps every other tensor the file
stores as the model holds it too (`_viewable`: the embeddings, norms, packed linears), so nothing of the
weights is copied (docs/perf-log.md#inference-load-views).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from hybrid.checkpoint_files import CheckpointError, CheckpointFiles, resolve_checkpoint
from hybrid.config import ConfigError, HybridConfig
from hybrid.dtypes import torch_dtype
from hybrid.model import HybridForCausalLM
from hybrid import parallel
from hybrid.parallel.files import ShardedFiles, full_shapes, packed_names
from hybrid.parallel.modules import attach_collectives, make_rank_model
from hybrid.parallel.packed import RowSubset, narrow_outputs, packed_shards
from hybrid.parallel.plan import Shard, ShardPlan
from hybrid.quantization import quantize_modules, read_quant_config, register_kv_scales
from moe.quant.kernels.prepacked import PrepackedExpertBank
from hybrid.ops import cpu as cpu_kernels
from moe.prepack import prepackable
from moe.quant import PackedExperts, PackedWeight, PrepackedLinear, QuantFormat, QuantLinear, swap_modules
from moe.quant.config import QuantConfig
from moe.quant.kernels import backend
from moe.quant.kernels import bf16

# `...experts.up_proj` (a float bank) or `...experts.up_proj.weight_scale` (a packed bank's tensors)
STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<proj>up_proj|down_proj)(?P<tensor>\.\w+)?$")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_QUANT_TENSOR_NAMES = {"weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale",
                       "input_global_scale", "weight_blocks", "weight_scales", "k_scale", "v_scale"}


def parse_dtype(dtype: str | torch.dtype | None, config: HybridConfig) -> torch.dtype:
    """The compute dtype: an explicit `dtype` (bf16, fp16, fp32, a config name or a torch dtype), else the
    config's `torch_dtype`.

    Raises:
        ValueError: an unknown dtype name.
    """
    return torch_dtype(config.torch_dtype if dtype is None else dtype)


def build_model(config: HybridConfig, dtype: torch.dtype, device: str | torch.device = "meta") -> HybridForCausalLM:
    """An uninitialised model in `dtype` (router and SSM parameters in fp32) on `device` (default: meta).

    Raises:
        ConfigError: the config describes more layers, experts or parameters than `HybridConfig.check_sizes`
            allows (checked arithmetically, before anything is built), or sizes that multiply to a tensor whose
            byte count overflows torch's int64; the message names the fields.
    """
    config.check_sizes()
    try:
        with torch.device(device):
            model = HybridForCausalLM(config)
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        fields, _ = max(config.parameter_terms(), key=lambda t: t[1])
        raise ConfigError(f"the config's sizes describe a tensor too large for torch: {fields} ({e})") from None
    return model.cast(dtype)


def load_model(
    path_or_repo: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    act_quant: bool = False,
    prepack: bool = True,
    progress: bool = True,
    mmap: bool = True,
    tensor_parallel: int | None = None,
) -> HybridForCausalLM:
    """Load a checkpoint directory (or hub repo id) into a `HybridForCausalLM` in eval mode.

    Args:
        path_or_repo: a local directory holding config.json and safetensors weights, or a hub repo id.
        dtype: compute dtype (`bf16`, `fp16`, `fp32`, or a torch dtype); default: the config's `torch_dtype`.
            Quantized weights stay packed in their stored format and are computed in this dtype.
        device: where the weights go.
        act_quant: for a quantized checkpoint, also quantize-dequantize the inputs of packed matmuls
            (W8A8 / W4A4 emulation) instead of the default weight-only compute.
        prepack: bf16 on a CPU with bf16 kernels: hold the linear and expert weights for them
            (`moe.prepack`, `moe.quant.kernels.bf16`; decode matrix-vector products faster than eager
            `F.linear`: docs/perf-log.md#bf16-decode-kernel). The model is then for inference only; pass
            False to keep plain `nn.Linear` modules (to quantize or train it).
        progress: a progress bar on stderr when loading takes more than 2 s.
        mmap: where prepacking keeps bf16 matrices as they are in the file (the plain form), and for the
            packed experts of a quantized checkpoint on the CPU, keep them as views of the read-only memory
            map, and with them every tensor the file stores as the model holds it (embeddings, norms, packed
            linears; the model is then for inference only) (the default: no copy, the page cache and the
            model share one, as llama.cpp maps its GGUF);
            False copies them into the process's own memory (llama.cpp's
            `--no-mmap`), which the OS cannot evict under page-cache pressure (other large files read
            meanwhile), at the cost of the copy at load.
        tensor_parallel: N > 1: this process's shard of the model over the N ranks of the initialised
            torch.distributed process group (`hybrid.parallel`): it reads only its parts of the files, and its
            forward gives the full model's logits. Packed (FP8, NVFP4, MXFP4) weights are cut at whole scale
            blocks (`hybrid.parallel.packed`).
    Raises:
        ConfigError: config.json unreadable or invalid (names the file and field).
        CheckpointError: missing shard, missing / unused tensor, shape mismatch, pickled weights, an
            unknown quantization method, or quantized tensors that do not match the declared format
            (names the file, tensor, module and format).
        ValueError: `tensor_parallel` differs from the process group's size. ConfigError: sizes that do not
            split `tensor_parallel` ways, packed weights included (a rank's input columns of a packed
            row-parallel weight that cut a scale block; names the module and format).
        KernelUnavailable: HYBRID_REQUIRE_CUDA_KERNELS=1 and a kernel package of the GPU path does not import
            (checked before anything is read: `hybrid.devices.check_required_kernels`).
    """
    from hybrid.devices import check_required_kernels

    check_required_kernels(device)
    directory = resolve_checkpoint(path_or_repo, revision)
    config = HybridConfig.from_file(directory / "config.json")
    quant = read_quant_config(directory, config)
    sharded = parallel.rank_plan(config, tensor_parallel, quant)
    if backend.cpu_kernels_on(device):
        cpu_kernels.build_kernels()  # all at once, now: never compiled between two tokens of a generation
    model = build_model(config, parse_dtype(dtype, config))
    files = CheckpointFiles(directory)
    if quant is not None:
        _quantize(model, quant, act_quant)
    if sharded is not None:
        plan, comm = sharded
        full = model
        model, shards, subsets = build_rank_model(full, plan, quant, act_quant)
        files = ShardedFiles(files, plan, full_shapes(full), shards, packed_names(full))
    if quant is not None:
        register_kv_scales(model, quant, files)
    prepack = prepack and model.dtype == torch.bfloat16 and backend.cpu_kernels_on(device) and bf16.available()
    load_weights(model, files, device, prepack=prepack, progress=progress, mmap=mmap)
    if sharded is not None:
        narrow_outputs(model, subsets)
        attach_collectives(model, plan, comm)
        model.parallel.read_bytes = files.read_bytes
    del files  # unmaps the checkpoint
    model.source_dir = Path(directory).resolve()  # save_checkpoint's default `source`: never saved onto
    return model.eval()


def _quantize(model: HybridForCausalLM, quant: QuantConfig, act_quant: bool) -> None:
    try:
        quantize_modules(model, quant, act_quant=act_quant)
    except ValueError as e:
        raise CheckpointError(f"quantized checkpoint: {e}") from None


def build_rank_model(full: HybridForCausalLM, plan: ShardPlan, quant: QuantConfig | None = None,
                     act_quant: bool = False) -> tuple[HybridForCausalLM, dict[str, Shard], dict[str, RowSubset]]:
    """Rank `plan.rank`'s model on meta, from the full model on meta (`build_model`, then `quantize_modules`
    with `quant`): (the rank model, uninitialised, for the loader; the Shard of each tensor of its packed
    modules; the packed modules whose rank holds extra rows, `hybrid.parallel.packed`).

    Raises:
        ConfigError: a packed column split that cuts a scale block (`ShardPlan` refuses such configs first).
        CheckpointError: `quant` does not apply to the rank's modules.
    """
    try:
        shards, subsets = packed_shards(full, plan)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model = make_rank_model(build_model(plan.local_config, full.dtype), full.config, plan)
    if quant is not None:
        _quantize(model, quant, act_quant)
        swap_modules(model, lambda name, m: _held_rows(m, subsets[name]) if name in subsets else None)
    return model, shards, subsets


def _held_rows(module: QuantLinear, subset: RowSubset) -> QuantLinear:
    """`module` (a rank's column-parallel packed linear, on meta) holding the rows `subset` names instead."""
    bias = module.bias
    return QuantLinear(module.fmt, module.in_features, subset.rows, bias is not None,
                       bias.dtype if bias is not None else torch.bfloat16, module.act_quant, "meta")


def load_weights(model: HybridForCausalLM, files: CheckpointFiles, device: str | torch.device = "cpu",
                 prepack: bool = False, progress: bool = False, mmap: bool = True) -> None:
    """Fill every parameter and buffer of `model` (built on meta) from `files`, strictly.

    prepack: the bf16 linears and expert banks `moe.prepack.prepackable` names are packed (`moe.quant.kernels.bf16`)
        as they are read, one matrix at a time (an expert bank is never whole in memory in its dense form).
    progress: a progress bar over the bytes read, shown once loading has taken 2 s.
    Raises:
        CheckpointError: see the module docstring; the message names the tensor(s) and file(s).
    """
    config = model.config
    tied = config.tie_word_embeddings
    packable = prepackable(model, device) if prepack else {}
    mappable = _mappable(model, files, device)
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if not (tied and n == "lm_head.weight")}
    owned = {f"{name}.{t}": targets.pop(f"{name}.{t}") for name, m in packable.items()
             for t in (("weight",) if isinstance(m, nn.Linear) else ("up_proj", "down_proj"))}
    owned.update({f"{name}.{t}": targets.pop(f"{name}.{t}") for name, m in mappable.items()
                  for t, _ in m.named_buffers(recurse=False)})
    sources = {n: _source_names(n, t, files) for n, t in model.state_dict(keep_vars=True).items()
               if n in targets or n in owned}
    _check_all(model, files, sources, {**targets, **owned})
    from tqdm import tqdm

    total = sum(files.nbytes(s) for names in sources.values() for s in names)
    inference = backend.cpu_kernels_on(device) and bool(packable or mappable)  # weights packed or mapped
    views = _viewable(targets, files, sources) if mmap and inference else {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="load", delay=2, disable=not progress) as bar:
        loaded, _, _ = read_tensors({n: t for n, t in targets.items() if n not in views}, files, device, model)
        loaded.update(views)
        bar.update(sum(files.nbytes(s) for n in targets for s in sources[n]))
        packed = {name: _packed(name, m, files, model, sources, bar, mmap) for name, m in packable.items()}
        mapped = {name: _mapped(name, m, files, sources, bar, mmap) for name, m in mappable.items()}
    if tied:
        loaded["lm_head.weight"] = loaded.get("backbone.embeddings.weight")
        if "lm_head.weight" in files:
            head = files.view("lm_head.weight")
            if head.shape != loaded["lm_head.weight"].shape or not torch.equal(
                head.to(loaded["lm_head.weight"].dtype).to(device), loaded["lm_head.weight"]
            ):
                raise CheckpointError(
                    f"{files.file_of('lm_head.weight')}: config.json sets tie_word_embeddings, but lm_head.weight "
                    "differs from backbone.embeddings.weight"
                )
    if packed or mapped:
        swap_modules(model, lambda name, m: packed.get(name, mapped.get(name)))
    if packed or views:
        model.requires_grad_(False)  # inference only: a backward pass raises (see moe.prepack)
    model.load_state_dict(loaded, strict=not (packed or mapped), assign=True)
    if tied:
        model.lm_head.weight = model.backbone.embeddings.weight


def _viewable(targets: dict[str, torch.Tensor], files: CheckpointFiles,
              sources: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """{name: read-only view of the memory map} of the CPU targets stored as the model holds them (one file
    tensor of the same name and dtype: the embeddings, norms, packed linears' bytes), for a load that is for
    inference anyway (prepacked or mapped weights): nothing copied, as for the experts; the 168 MB
    embedding matrix of a Nano-width model was copied before. The shapes were checked by `_check_all`."""
    return {n: files.view(n).reshape(t.shape) for n, t in targets.items()
            if sources.get(n) == [n] and files.dtype(n) == t.dtype}


def _check_all(model: HybridForCausalLM, files: CheckpointFiles, sources: dict[str, list[str]],
               targets: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError, before anything is read, for a file tensor whose shape or dtype its target does
    not declare (the first in the state dict's order), tensors the model needs and the files lack, and
    tensors in the files the model does not use."""
    config = model.config
    packed = _packed_owner(model)
    for name, names in sources.items():
        target = targets[name]
        shape = tuple(target.shape[1:]) if names != [name] else tuple(target.shape)  # per-expert tensors
        for s in names:
            if s in files:
                _check(s, shape, target.dtype, files, name, packed.get(name), model)
    missing = [s for names in sources.values() for s in names if s not in files]
    if missing:
        raise CheckpointError(
            f"{files.directory}: {len(missing)} tensor(s) the config "
            f"(pattern {config.hybrid_override_pattern!r}) needs are missing: {_first(missing)}"
        )
    used = {s for names in sources.values() for s in names}
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # checked against the embeddings once they are read
    unused = sorted(set(files.keys()) - used)
    if unused:
        quant = model.quantization
        hint = ""
        if any(u.rpartition(".")[2] in _QUANT_TENSOR_NAMES for u in unused):
            hint = (f"; quantization tensors of modules that {quant.source} leaves unquantized" if quant is not None
                    else "; quantization tensors, but the checkpoint declares no quantization config")
        raise CheckpointError(
            f"{files.directory}: {len(unused)} tensor(s) in the files are not used by the model "
            f"(pattern {config.hybrid_override_pattern!r}): {_first(unused)}{hint}"
        )


def _packed(name: str, module: nn.Module, files: CheckpointFiles, model: HybridForCausalLM,
            sources: dict[str, list[str]], bar, mmap: bool = True) -> nn.Module:
    """The prepacked form of meta module `name`, packed from the files one matrix at a time (each read as a
    bf16 view of the map, or a copy without `mmap` or for another dtype, packed, its pages released)."""

    def read(source: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A bf16 file tensor as a view of the memory map (packed straight from it, then its pages
        released: no temporary copy) or, without `mmap`, a copy of it; converted copies for other dtypes."""
        bar.update(files.nbytes(source))
        if files.dtype(source) == torch.bfloat16:
            return files.view(source) if mmap else files.view(source).clone()
        return read_tensor(files, source, shape, torch.bfloat16, model)

    if isinstance(module, nn.Linear):
        source = sources[f"{name}.weight"][0]
        w = read(source, tuple(module.weight.shape))
        packed = PrepackedLinear(module, w)
        files.release(source)
        return packed
    stacks = {proj: getattr(module, proj) for proj in ("up_proj", "down_proj")}

    def experts():
        for j in range(module.n_experts):
            pair, names = [], []
            for proj, stack in stacks.items():
                sources_of = sources[f"{name}.{proj}"]
                if sources_of != [f"{name}.{proj}"]:  # one tensor per expert
                    names.append(sources_of[j])
                    w = read(sources_of[j], tuple(stack.shape[1:]))
                else:  # stored stacked
                    w = read_tensor(files, sources_of[0], tuple(stack.shape), torch.bfloat16, model)[j]
                pair.append(w)
            yield tuple(pair)  # packed by the bank
            for source in names:
                files.release(source)

    return PrepackedExpertBank(module, experts())


def _mappable(model: HybridForCausalLM, files: CheckpointFiles, device: str | torch.device) -> dict[str, PackedWeight]:
    """{name: packed expert stack} of the stacks to hold per expert (`moe.quant.PackedExperts`): on the CPU,
    those whose file tensors are per expert (an already stacked checkpoint loads into stacks)."""
    if not backend.cpu_kernels_on(device):
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedWeight) and m.n_experts is not None
            and not any(f"{name}.{t}" in files for t, _ in m.named_buffers(recurse=False))}


def _mapped(name: str, module: PackedWeight, files: CheckpointFiles, sources: dict[str, list[str]], bar,
            mmap: bool = True) -> PackedExperts:
    """The `PackedExperts` form of meta stack `name`: each expert's tensors views of the memory map (read by
    the first forward that uses them, from the page cache: nothing is copied) or, without `mmap`, copies
    (their pages then released). The tensors were checked by `_check_all`."""
    experts = []
    for j in range(module.n_experts):
        part = {}
        for t, _ in module.named_buffers(recurse=False):
            source = sources[f"{name}.{t}"][j]
            bar.update(files.nbytes(source))
            part[t] = files.view(source) if mmap else files.view(source).clone()
            if not mmap:
                files.release(source)
        experts.append(part)
    return PackedExperts(module.fmt, module.out_features, module.in_features, experts)


def read_tensors(targets: dict[str, torch.Tensor], files: CheckpointFiles, device: str | torch.device,
                 model: HybridForCausalLM) -> tuple[dict[str, torch.Tensor], set[str], list[str]]:
    """New tensors shaped and typed like `targets` ({model tensor name: tensor of `model`, usually on meta}),
    each copied once from its file tensor(s) (per-expert tensors stacked), strictly checked.

    Returns (the tensors by name, the file tensor names used, the file tensor names missing).
    Raises:
        CheckpointError: a file tensor whose shape or dtype the target does not declare (see `_copy_checked`).
    """
    packed = _packed_owner(model)
    loaded, used, missing = {}, set(), []
    for name, target in targets.items():
        sources = _source_names(name, target, files)
        if any(s not in files for s in sources):
            missing.extend(s for s in sources if s not in files)
            continue
        out = torch.empty(target.shape, dtype=target.dtype, device=device)
        owner = packed.get(name)
        if sources == [name]:
            _copy_checked(out, sources[0], files, name, owner, model)
        else:
            for j, s in enumerate(sources):
                _copy_checked(out[j], s, files, name, owner, model)
        used.update(sources)
        loaded[name] = out
    return loaded, used, missing


def read_tensor(files: CheckpointFiles, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                model: HybridForCausalLM) -> torch.Tensor:
    """File tensor `name` copied into a new float tensor of `shape` and `dtype`, strictly checked (the one-
    tensor form of `read_tensors`, for code that reads a checkpoint piece by piece).

    Raises:
        CheckpointError: the tensor is missing, or its shape or dtype is not the declared one.
    """
    if name not in files:
        raise CheckpointError(f"{files.directory}: tensor {name!r} the config (pattern "
                              f"{model.config.hybrid_override_pattern!r}) needs is missing")
    out = torch.empty(shape, dtype=dtype)
    _copy_checked(out, name, files, name, None, model)
    return out


def _source_names(name: str, target: torch.Tensor, files: CheckpointFiles) -> list[str]:
    """Checkpoint tensor names that make up model tensor `name` (several for stacked experts)."""
    m = STACKED_EXPERTS.match(name)
    if m and name not in files:
        return [f"{m['prefix']}.{j}.{m['proj']}{m['tensor'] or '.weight'}" for j in range(target.shape[0])]
    return [name]


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _copy_checked(out: torch.Tensor, name: str, files: CheckpointFiles, model_name: str,
                  owner: tuple[str, QuantFormat] | None, model: HybridForCausalLM) -> None:
    """Copy file tensor `name` into `out` after `_check` (then drop its pages of the memory map)."""
    _check(name, tuple(out.shape), out.dtype, files, model_name, owner, model)
    out.copy_(files.view(name).reshape(out.shape) if owner is not None else files.view(name))
    files.release(name)


def _check(name: str, want_shape: tuple[int, ...], want_dtype: torch.dtype, files: CheckpointFiles, model_name: str,
           owner: tuple[str, QuantFormat] | None, model: HybridForCausalLM) -> None:
    """Refuse file tensor `name` for a target of `want_shape` / `want_dtype` it does not fit.

    A packed module's tensors (`owner` = (module, format)) keep their dtype exactly; their shapes may differ
    from the declared ones only by size-1 dimensions (scalars stored as [] or [1], per-channel scales as
    [out] or [out, 1], block scales as [R, C] or ModelOpt's [R, 1, C, 1]). Other targets take any float
    dtype (converted) in exactly their shape.
    """
    shape, dtype = tuple(files.shape(name)), files.dtype(name)
    if owner is not None:
        module, fmt = owner
        if dtype != want_dtype or (shape != want_shape and _squeezed(shape) != _squeezed(want_shape)):
            raise CheckpointError(_mismatch(files, name, model_name, module, fmt, want_shape, want_dtype,
                                            model.quantization))
        return
    if dtype not in _FLOAT_DTYPES:
        quant = model.quantization
        why = ("quantized tensors need a quantization config" if quant is None else
               f"quantized checkpoint: {quant.source} leaves this module unquantized, so a floating-point weight "
               "is expected")
        raise CheckpointError(f"{files.file_of(name)}: tensor {name!r} is {dtype}, not a floating-point weight; {why}")
    if shape != want_shape:
        raise CheckpointError(
            f"{files.file_of(name)}: tensor {name!r} has shape {list(shape)}; the config expects {list(want_shape)}"
        )


def _packed_owner(model: nn.Module) -> dict[str, tuple[str, QuantFormat]]:
    """{state-dict name: (module name, format)} of every tensor held by a packed module."""
    return {f"{name}.{tname}": (name, module.fmt) for name, module in model.named_modules()
            if isinstance(module, PackedWeight) for tname, _ in module.named_buffers(recurse=False)}


def _mismatch(files: CheckpointFiles, source: str, model_name: str, module: str, fmt: QuantFormat, want_shape,
              want_dtype, qc: QuantConfig | None) -> str:
    """Why file tensor `source` cannot fill a packed module's tensor (names the config that declared it)."""
    where = qc.source if qc is not None else "the quantization config"
    return (f"{files.file_of(source)}: quantized checkpoint: tensor {source!r} is {files.dtype(source)} "
            f"{list(files.shape(source))}, but {where} declares module {module!r} {fmt.label}, which stores "
            f"{model_name.rpartition('.')[2]!r} as {want_dtype} {list(want_shape)}")


def _first(names: list[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" ... and {len(names) - n} more" if len(names) > n else "")


def load(
    path_or_repo: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    act_quant: bool = False,
    prepack: bool = True,
    progress: bool = True,
    mmap: bool = True,
    tensor_parallel: int | None = None,
):
    """Load a model and its tokenizer: `(HybridForCausalLM, Tokenizer)`.

    The tokenizer's `stop_ids` are the union of config.json's, generation_config.json's and the
    tokenizer's eos ids. Tokenizer entries past the model's vocabulary (`config.vocab_size`) are noted with a
    UserWarning: such ids cannot be fed to the model (the forward refuses them), though padding with them
    works. Raises what `load_model` and `Tokenizer.from_dir` raise.
    """
    import warnings

    from hybrid.tokenizer import Tokenizer

    directory = resolve_checkpoint(path_or_repo, revision)
    model = load_model(directory, dtype, device, act_quant=act_quant, prepack=prepack, progress=progress, mmap=mmap,
                       tensor_parallel=tensor_parallel)
    tokenizer = Tokenizer.from_dir(directory, config_eos=model.config.eos_token_ids, config_pad=model.config.pad_token_id)
    vocab = model.config.vocab_size
    extra = tokenizer.tokens_from(vocab)
    if extra:
        shown = ", ".join(f"{t!r} = {i}" for i, t in list(extra.items())[:5]) + (" ..." if len(extra) > 5 else "")
        one = len(extra) == 1
        warnings.warn(f"{directory}: the tokenizer has {len(extra)} token{'' if one else 's'} past the model's "
                      f"vocabulary (config.vocab_size {vocab}): {shown}; {'it' if one else 'they'} cannot be fed "
                      "to the model (padding with them is fine)", stacklevel=2)
    return model, tokenizer
