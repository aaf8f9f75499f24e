"""Quantize a float model to FP8, NVFP4 or MXFP4 and write it in ModelOpt's checkpoint layout.

    quantize_checkpoint("src/", "out/", "nvfp4", calibration=[ids, ...])     # streamed: `hybrid quantize`
    model = quantize_model(model, "nvfp4", exclude=None, calibration=[ids, ...])     # in memory, in place
    save_checkpoint(model, "out/")          # hf_quant_config.json + config.json `quantization_config`

`quantize_checkpoint` never holds the model: calibration carries the calibration batches' hidden states
through one layer at a time (the layer's weights read from the files, a bank's experts one at a time), then
every tensor is read, quantized (an expert at a time) and written to shards of `max_shard_bytes`, so its
memory does not grow with the model. It gives the checkpoint `quantize_model` + `save_checkpoint` give, bit
for bit (tests/test_quantize_streaming.py).

Formats (ModelOpt `quant_algo`): fp8 = FP8 (per-tensor E4M3 weight scale, static input scale), nvfp4 =
NVFP4 (E2M1 in blocks of 16, E4M3 block scales, fp32 global scale, static input scale), mxfp4 = MXFP4
(E2M1 in blocks of 32, E8M0 scales; no input scale). Static input scales are `amax / 448` (FP8) and
`amax / (6 * 448)` (NVFP4) of each module's inputs over the calibration batches (ModelOpt's max
calibration); an expert that no calibration token reached gets the largest amax of its bank, as
ModelOpt's export does for uncalibrated experts.

Default exclusions (`default_exclusions`) follow the Nemotron 3 Nano NVFP4 release: lm_head, the
embeddings, every attention layer's projections, the in/out projections of the Mamba layer feeding each
attention layer, every conv1d, the routers (`mixer.gate`), and the MTP block. `exclude` replaces them; a
head tied to the embeddings (`tie_word_embeddings`) is always kept unquantized (one matrix, stored once, as
the embedding), with a note, and recorded among the exclusions.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import nn

from hybrid.cache import StepContext
from hybrid.checkpoint_files import CheckpointError, CheckpointFiles, resolve_checkpoint
from hybrid.checkpoint_writer import CheckpointWriter, WriteReport
from hybrid.config import ATTENTION, MAMBA, HybridConfig
from hybrid.loading import build_model, parse_dtype, read_tensor, read_tensors
from hybrid.model import HybridForCausalLM
from hybrid.quantization import bank_format, quantize_modules, read_quant_config
from hybrid.saving import write_config_files
from moe.calibration import InputAmax
from moe.experts import DenseStack, ExpertBank, QuantExpertBank
from moe.prepack import unpack
from moe.quant import PackedWeight, QuantLinear, formats
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
    qc = _modelopt_config(fmt_name, exclude)
    if config.tie_word_embeddings and qc.format_for("lm_head") is not None:
        print("note: lm_head is tied to the embeddings (tie_word_embeddings): keeping it unquantized "
              "(added to the excluded modules)", file=sys.stderr)
        qc = _modelopt_config(fmt_name, exclude + ["lm_head"])
    return qc


def _modelopt_config(fmt_name: str, exclude: list[str]) -> QuantConfig:
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


def _calibrated(name: str, module: nn.Module, qc: QuantConfig) -> bool:
    """Whether calibration records the inputs of `module`: a Linear or an expert bank `qc` quantizes."""
    if isinstance(module, nn.Linear):
        return qc.format_for(name) is not None
    if isinstance(module, ExpertBank):
        return any(bank_format(qc, name, proj, module.n_experts) is not None for proj in ("up_proj", "down_proj"))
    return False


@torch.no_grad()
def calibrate(model: nn.Module, qc: QuantConfig, batches: list[torch.Tensor]) -> InputAmax:
    """Run `batches` ([1, T] int64 each) through `model`, recording (by forward pre-hooks) the input amax of
    every Linear and expert bank `qc` quantizes."""
    stats = InputAmax()
    handles = [stats.attach(name, module) for name, module in model.named_modules() if _calibrated(name, module, qc)]
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


# ---------------------------------------------------------------------------------------------- streamed
class _FileExpertBank(ExpertBank):
    """An expert bank of a partly loaded model whose experts are read from the checkpoint files when used
    (a copy in the model dtype, the file's pages released at once), so a calibration pass over it holds one
    expert at a time."""

    def __init__(self, files: CheckpointFiles, prefix: str, bank: ExpertBank, model: HybridForCausalLM,
                 device: torch.device | str = "cpu"):
        nn.Module.__init__(self)  # no stacked parameters: the experts stay in the files
        E, I, L = bank.up_proj.shape
        dtype = bank.up_proj.dtype
        self.experts = E
        self.read = lambda e, proj, shape: _read_expert(files, prefix, e, proj, shape, dtype, model).to(device)
        self.shapes = {"up_proj": (I, L), "down_proj": (L, I)}

    @property
    def n_experts(self) -> int:
        return self.experts

    def weights_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(e, "up_proj", self.shapes["up_proj"]), self.read(e, "down_proj", self.shapes["down_proj"])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.dispatch_each(x, weights, ids)  # expert by expert, each read when chosen


def _read_expert(files: CheckpointFiles, bank: str, e: int, proj: str, shape, dtype, model) -> torch.Tensor:
    """Expert e's float `proj` weight from the files (per-expert or already stacked), pages released."""
    name = f"{bank}.{e}.{proj}.weight"
    if name not in files and f"{bank}.{proj}" in files:  # an already stacked checkpoint
        stacked = read_tensor(files, f"{bank}.{proj}", tuple(files.shape(f"{bank}.{proj}")), dtype, model)
        return stacked[e].clone()
    t = read_tensor(files, name, shape, dtype, model)
    files.release(name)
    return t


def _materialize(module: nn.Module, prefix: str, files: CheckpointFiles, model: HybridForCausalLM,
                 device: torch.device | str = "cpu") -> None:
    """Give `module` (a meta submodule of `model`, named `prefix`) its tensors from the files, on `device`, in
    place."""
    targets = {prefix + n: t for n, t in module.state_dict(keep_vars=True).items()}
    loaded, used, missing = read_tensors(targets, files, device, model)
    if missing:
        raise CheckpointError(f"{files.directory}: {len(missing)} tensor(s) the config needs are missing: {missing[:8]}")
    for name in used:
        files.release(name)
    module.load_state_dict({n[len(prefix):]: t for n, t in loaded.items()}, assign=True)


@torch.no_grad()
def calibrate_streamed(files: CheckpointFiles, config: HybridConfig, dtype: torch.dtype, qc: QuantConfig,
                       batches: list[torch.Tensor], progress: str | None = None,
                       device: torch.device | str = "cpu") -> InputAmax:
    """`calibrate` without the model in memory: the batches' hidden states go through one layer at a time,
    each layer's weights read from `files` for its turn (a bank's experts one at a time) and dropped after.
    Records bit for bit what `calibrate` records on the loaded model (the same operations on the same
    numbers, only in another order). `progress`: the description of a tqdm bar over the layers (None: no
    bar; a Nano-sized MoE layer takes long enough on a small CPU to want one:
    docs/perf-log.md#calibration-progress). `device`: where the layers run (their weights read onto it)."""
    model = build_model(config, dtype)  # meta: names, shapes and dtypes
    stats = InputAmax()

    def run_part(prefix: str, module: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`module` (named `prefix`) read from the files, run on `inputs` with hooks attached, dropped."""
        for name, child in list(module.named_modules()):
            if isinstance(child, ExpertBank):  # experts from the files, one at a time
                parent, _, attr = name.rpartition(".")
                setattr(module.get_submodule(parent), attr,
                        _FileExpertBank(files, f"{prefix}{name}", child, model, device))
        _materialize(module, prefix, files, model, device)
        named = [((prefix + name) if name else prefix[:-1], m) for name, m in module.named_modules()]
        handles = [stats.attach(full, m) for full, m in named if _calibrated(full, m, qc)]
        outputs = [module(h, StepContext(past=0, mask=None, key_mask=None)) if prefix.startswith("backbone.layers.")
                   else module(h) for h in inputs]
        for h in handles:
            h.remove()
        module.to_empty(device="meta")  # drop this layer's weights
        return outputs

    hidden = run_part("backbone.embeddings.", model.backbone.embeddings, [ids.to(device) for ids in batches])
    layers = enumerate(model.backbone.layers)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, total=len(model.backbone.layers), unit="layer", desc=progress)
    for i, block in layers:
        hidden = run_part(f"backbone.layers.{i}.", block, hidden)
    if qc.format_for("lm_head") is not None and not config.tie_word_embeddings:
        hidden = run_part("backbone.norm_f.", model.backbone.norm_f, hidden)
        run_part("lm_head.", model.lm_head, hidden)
    for name, module in model.named_modules():  # the MTP block never runs in calibration, in memory neither:
        if name.startswith("mtp.") and _calibrated(name, module, qc):  # attached, nothing recorded
            stats.attach(name, module).remove()
    stats.fill_unreached()
    return stats


def _float(files: CheckpointFiles, name: str, like: torch.Tensor, model: HybridForCausalLM, used: set[str]):
    t = read_tensor(files, name, tuple(like.shape), like.dtype, model)
    files.release(name)
    used.add(name)
    return t


def _module_tensors(name: str, module: nn.Module, files: CheckpointFiles, stats: InputAmax,
                    model: HybridForCausalLM, used: set[str]):
    """(published name, tensor) of one module of the output model (meta), read from the files and quantized
    where the module is packed: a Linear's weight at once, a bank's experts one at a time."""
    prefix = f"{name}." if name else ""
    if isinstance(module, QuantLinear):
        w = _float(files, f"{prefix}weight", torch.empty(module.out_features, module.in_features,
                                                         dtype=model.dtype, device="meta"), model, used)
        for tname, t in module.fmt.quantize(w, stats.linear.get(name, torch.tensor(0.0))).items():
            yield prefix + tname, t
        if module.bias is not None:
            yield prefix + "bias", _float(files, f"{prefix}bias", module.bias, model, used)
        return
    if isinstance(module, QuantExpertBank):
        amax = stats.experts.get(name, (torch.zeros(module.n_experts), torch.zeros(module.n_experts)))
        for j in range(module.n_experts):
            for proj, a in (("up_proj", amax[0]), ("down_proj", amax[1])):
                p = getattr(module, proj)
                shape = (p.out_features, p.in_features) if isinstance(p, PackedWeight) else tuple(p.weight.shape[1:])
                w = _float(files, f"{prefix}{j}.{proj}.weight", torch.empty(shape, dtype=model.dtype, device="meta"),
                           model, used)
                if isinstance(p, DenseStack):
                    yield f"{prefix}{j}.{proj}.weight", w
                    continue
                for tname, t in p.fmt.quantize(w, a[j]).items():
                    yield f"{prefix}{j}.{proj}.{tname}", t
        return
    for tname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue  # the tied head is the embedding matrix
        if isinstance(module, ExpertBank):  # a float bank: one tensor per expert, as published
            for j in range(t.shape[0]):
                yield f"{prefix}{j}.{tname}.weight", _float(files, f"{prefix}{j}.{tname}.weight", t[j], model, used)
            continue
        yield prefix + tname, _float(files, prefix + tname, t, model, used)


def _owned_by_packed(name: str, packed: set[str]) -> bool:
    return any(name.startswith(p + ".") for p in packed)


def _write_tensors(writer: CheckpointWriter, out: HybridForCausalLM, files: CheckpointFiles, stats: InputAmax,
                   packed: set[str], used: set[str], progress: str | None) -> None:
    """Every tensor of the output model (meta `out`) to `writer`, module by module; `progress`: the
    description of a tqdm bar over the source tensors (None: no bar)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(1 for _ in files.keys()), unit="tensor", desc=progress)
    for name, module in out.named_modules():
        if _owned_by_packed(name, packed):
            continue  # written with the packed module that holds it
        before = len(used)
        for tname, t in _module_tensors(name, module, files, stats, out, used):
            writer.add(tname, t)
        if bar is not None:
            bar.update(len(used) - before)
    if bar is not None:
        bar.close()


@torch.no_grad()
def quantize_checkpoint(source: str | Path, destination: str | Path, fmt_name: str, exclude: list[str] | None = None,
                        calibration: list[torch.Tensor] | None = None, dtype: str | torch.dtype | None = None,
                        max_shard_bytes: int | None = 512 * 2**20, overwrite: bool = False,
                        progress: bool = False, device: torch.device | str = "cpu") -> WriteReport:
    """Quantize the float checkpoint `source` into `destination` tensor by tensor (see the module docstring).

    calibration: token batches ([1, T] int64 each) for the static input scales (FP8, NVFP4); dtype: of the
    unquantized tensors and the calibration (default: the config's). progress: tqdm bars over the calibration's
    layers and the source tensors. device: where the calibration runs. Returns the writer's report (shards,
    copied files).
    Raises:
        WriteError: the destination is the source, inside or around it, not empty without `overwrite`, or
            cannot be created (checked before anything else is done).
        OSError: a write failed (the destination is then as it was).
        ValueError / CheckpointError: an already quantized source, an unknown format, a module the format
            cannot store, missing, unused or mistyped tensors.
    """
    src = resolve_checkpoint(source)
    # the destination first (checked, its temporary directory made): a failure costs nothing; any error below
    # discards the temporary directory and leaves the destination as it was
    with CheckpointWriter(destination, source=src, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        config = HybridConfig.from_file(src / "config.json")
        if (existing := read_quant_config(src, config)) is not None:
            raise ValueError(f"{source} is already quantized ({existing.source})")
        dtype = parse_dtype(dtype, config)
        qc = plan(config, fmt_name, exclude)
        files = CheckpointFiles(src)
        bar = f"calibrate {fmt_name}" if progress else None
        stats = (calibrate_streamed(files, config, dtype, qc, calibration, bar, device)
                 if calibration and has_static_inputs(fmt_name) else InputAmax())
        out = build_model(config, dtype)  # meta: the output's modules, names, shapes and dtypes
        quantize_modules(out, qc)
        packed = {n for n, m in out.named_modules() if isinstance(m, (QuantExpertBank, QuantLinear))}
        used: set[str] = set()
        hub = not Path(source).expanduser().is_dir()
        write_config_files(writer, out.config, dtype, qc, src, source_name=str(source) if hub else None)
        _write_tensors(writer, out, files, stats, packed, used, f"quantize {fmt_name}" if progress else None)
        if config.tie_word_embeddings and "lm_head.weight" in files:
            used.add("lm_head.weight")  # the loader checks it equals the embeddings
        unused = sorted(set(files.keys()) - used)
        if unused:
            raise CheckpointError(f"{src}: {len(unused)} tensor(s) in the files are not used by the model: "
                                  f"{unused[:8]}")
    return writer.report
