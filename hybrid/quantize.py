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
from hybrid.ops import onednn
from hybrid.quantized_loading import bank_format, set_module
from moe.experts import ExpertBank
from moe.quant.config import HF_QUANT_CONFIG, QuantConfig, modelopt_config_files, modelopt_format
from moe.quant.experts import QuantExpertBank, relu2
from moe.quant.linear import QuantLinear

FORMATS = {"fp8": "FP8", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


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
    """The `QuantConfig` (with its files) of quantizing `config`'s model to `fmt_name` (fp8, nvfp4, mxfp4)."""
    if fmt_name not in FORMATS:
        raise ValueError(f"--format {fmt_name!r} is not supported; expected one of {sorted(FORMATS)}")
    fmt = modelopt_format(FORMATS[fmt_name])
    exclude = default_exclusions(config) if exclude is None else list(exclude)
    try:
        producer = {"name": "hybrid-moe", "version": version("hybrid-moe")}
    except PackageNotFoundError:
        producer = {"name": "hybrid-moe", "version": "unknown"}
    hf_quant, block = modelopt_config_files(fmt, exclude, producer)
    qc = QuantConfig.from_modelopt(hf_quant, HF_QUANT_CONFIG)
    qc.files["config.json"] = block
    return qc


class _Amax:
    """Running max of |inputs| per Linear (scalar) and per expert (vector) during calibration."""

    def __init__(self):
        self.linear: dict[str, torch.Tensor] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def linear_hook(self, name: str):
        def hook(module, args):
            a = args[0].detach().abs().amax().float()
            self.linear[name] = torch.maximum(self.linear.get(name, a), a)
        return hook

    def bank_forward(self, name: str, bank: ExpertBank):
        """A forward for `bank` that records per-expert amax of the up and down projections' inputs."""
        E = bank.up_proj.shape[0]
        up, down = torch.zeros(E), torch.zeros(E)
        self.experts[name] = (up, down)
        plain = bank.forward

        def forward(x, weights, ids):
            flat = ids.reshape(-1)
            for e in flat.unique().tolist():
                xe = x[(ids == e).any(dim=-1)]
                up[e] = torch.maximum(up[e], xe.abs().amax().float())
                down[e] = torch.maximum(down[e], relu2(xe @ bank.up_proj[e].T).abs().amax().float())
            return plain(x, weights, ids)
        return forward


@torch.no_grad()
def calibrate(model: nn.Module, qc: QuantConfig, batches: list[torch.Tensor]) -> _Amax:
    """Run `batches` ([1, T] int64 each) through `model`, recording the input amax of every module `qc`
    quantizes."""
    stats, handles, banks = _Amax(), [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and qc.format_for(name) is not None:
            handles.append(module.register_forward_pre_hook(stats.linear_hook(name)))
        elif isinstance(module, ExpertBank):
            module.forward = stats.bank_forward(name, module)
            banks.append(module)
    try:
        for ids in batches:
            model(ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
        for bank in banks:
            del bank.forward  # back to the class's forward
    for up, down in stats.experts.values():  # experts no token reached: the bank's largest amax
        up[up == 0] = up.max()
        down[down == 0] = down.max()
    return stats


@torch.no_grad()
def quantize_model(model: nn.Module, fmt_name: str, exclude: list[str] | None = None,
                   calibration: list[torch.Tensor] | None = None) -> nn.Module:
    """Quantize `model` (a float `HybridForCausalLM`) in place; returns it, with `model.quantization` set so
    that `save_checkpoint` writes the ModelOpt layout. `calibration`: token batches for the static input
    scales (FP8, NVFP4); without them, every input scale is 1.0."""
    if getattr(model, "quantization", None) is not None:
        raise ValueError("the model is already quantized")
    onednn.unpack(model)  # a model loaded for CPU inference holds prepacked weights: back to plain modules
    qc = plan(model.config, fmt_name, exclude)
    stats = calibrate(model, qc, calibration) if calibration else _Amax()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            fmt = qc.format_for(name)
            if fmt is not None:
                fmt.check_shape(module.out_features, module.in_features, name)
                amax = stats.linear.get(name, torch.tensor(0.0))
                set_module(model, name, QuantLinear.from_linear(module, fmt, amax))
        elif isinstance(module, ExpertBank):
            E = module.up_proj.shape[0]
            up_fmt, down_fmt = bank_format(qc, name, "up_proj", E), bank_format(qc, name, "down_proj", E)
            if up_fmt is None and down_fmt is None:
                continue
            up_amax, down_amax = stats.experts.get(name, (torch.zeros(E), torch.zeros(E)))
            set_module(model, name, QuantExpertBank.from_bank(module, up_fmt, down_fmt, up_amax, down_amax))
    model.quantization = qc
    model.config.quantization_config = qc.files["config.json"]
    return model

