"""What training a hybrid model from scratch needs beyond PyTorch: initialisation, the language-model loss
(with the optional MTP term), auxiliary-loss-free expert balancing, and the learning-rate schedule.

- Initialisation follows transformers' NemotronH / mamba-ssm: normal(0, initializer_range) weights, residual
  output projections scaled by 1/sqrt(2 * num_layers) (GPT-2), A = uniform(1, 16) (A_log = log A),
  D = 1, dt_bias = softplus^-1(dt) with dt log-uniform in [time_step_min, time_step_max] (floored at
  time_step_floor), norms 1, biases and the correction bias 0 (`init_tensor`, one tensor at a time;
  `write_random_checkpoint` streams a whole random checkpoint of any size to disk with it).
- Balancing is DeepSeek-V3's auxiliary-loss-free strategy (Liu et al. 2024, section 2.1.2): after every
  optimiser step, each MoE layer's `e_score_correction_bias` moves by `rate` towards balance,
  `b_i += rate * sign(mean_load - load_i)`. The bias only affects which experts are chosen, never their
  weights, which is exactly how the router uses it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid.checkpoint_writer import CheckpointWriter
from hybrid.config import HybridConfig
from hybrid.loading import build_model
from hybrid.model import HybridForCausalLM
from hybrid.saving import published_tensors, write_config_files
from moe.router import TopkRouter

_RESIDUAL_OUT = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj", "fc2_latent_proj.weight")


def init_tensor(name: str, shape: tuple[int, ...], config: HybridConfig, generator: torch.Generator) -> torch.Tensor:
    """The initial value (float32) of the tensor `name` (ours or its published name) of shape `shape`, drawn
    from `generator` (see the module docstring)."""
    std = config.initializer_range
    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=generator) * 15 + 1)
    if name.endswith(".D") or name.endswith(("norm.weight", "norm_f.weight")):
        return torch.ones(shape)
    if name.endswith("dt_bias"):
        lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
        dt = torch.exp(torch.rand(shape, generator=generator) * (hi - lo) + lo).clamp(min=config.time_step_floor)
        return dt + torch.log(-torch.expm1(-dt))  # softplus^-1
    if name.endswith("conv1d.weight"):
        return (torch.rand(shape, generator=generator) * 2 - 1) * (1.0 / math.sqrt(shape[-1]))
    if name.endswith("bias"):  # biases and the routers' e_score_correction_bias
        return torch.zeros(shape)
    scale = 1.0 / math.sqrt(2 * config.num_hidden_layers) if name.endswith(_RESIDUAL_OUT) else 1.0
    return torch.randn(shape, generator=generator) * std * scale


@torch.no_grad()
def init_weights(model: HybridForCausalLM, seed: int) -> None:
    """Initialise every parameter and buffer of `model` in place (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(init_tensor(name, tuple(p.shape), model.config, g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def write_random_checkpoint(config: HybridConfig, directory: str | Path, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = 512 * 2**20,
                            extra_files: tuple[Path, ...] = ()) -> Path:
    """A checkpoint of `config` with `init_tensor` weights in `dtype` (router and SSM parameters in fp32, as
    published checkpoints store them), written tensor by tensor in the published layout (one tensor per
    expert, sharded, with an index): memory stays at one shard, whatever the model's size. `extra_files`
    (tokenizer files, ...) are copied in. Returns the directory."""
    model = build_model(config, dtype, device="meta")  # names, shapes and dtypes only
    g = torch.Generator().manual_seed(seed)
    with CheckpointWriter(directory, max_shard_bytes=max_shard_bytes) as writer:
        write_config_files(writer, config, dtype, None, None)
        for path in extra_files:
            writer.copy(path)
        for name, t in published_tensors(model):
            writer.add(name, init_tensor(name, tuple(t.shape), config, g).to(t.dtype))
    return Path(directory)


def learning_rate(progress: float, peak: float, warmup: float, final: float = 0.0) -> float:
    """Linear warm-up over the first `warmup` fraction of the run, then cosine decay from `peak` to
    `final * peak` at the end (`progress` in [0, 1])."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t)))


def _weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    if weights is None:
        return ce.mean()
    w = weights.reshape(-1).to(ce.dtype)
    return (ce * w).sum() / w.sum()


def lm_loss(model: HybridForCausalLM, tokens: torch.Tensor, mtp_weight: float = 0.0,
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Next-token cross-entropy over `tokens` [B, T+1] (inputs [:, :-1], targets [:, 1:]), plus
    `mtp_weight` times the MTP block's cross-entropy on the token after next, when the model has one.

    weights: optional [B, T] per-target weights (a weighted mean; e.g. to stress the answers of recall tasks).
    Returns (loss, {"lm": float, "mtp": float or None}).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    hidden = model.hidden_states(inputs)
    lm = _weighted_ce(model.logits(hidden), targets, weights)
    parts = {"lm": lm.item(), "mtp": None}
    if model.mtp is None or mtp_weight == 0:
        return lm, parts
    # position t: hidden state t and token t+1 predict token t+2
    mtp = model.mtp_logits(hidden[:, :-1], targets[:, :-1])
    mtp_loss = _weighted_ce(mtp, targets[:, 1:], None if weights is None else weights[:, 1:])
    parts["mtp"] = mtp_loss.item()
    return lm + mtp_weight * mtp_loss, parts


def train_step(model: HybridForCausalLM, optimizer: torch.optim.Optimizer, balancer: "ExpertBalancer",
               tokens: torch.Tensor, weights: torch.Tensor | None = None, mtp_weight: float = 0.0,
               lr: float | None = None, max_grad_norm: float = 1.0) -> dict:
    """One optimiser step on `tokens` [B, T+1] (`lm_loss` under bf16 autocast, gradients clipped to
    `max_grad_norm`, then the expert balancer's bias update), at learning rate `lr` when given. Returns the
    step's record: {"loss", "mtp_loss", "grad_norm", "max_over_mean_load"}."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, parts = lm_loss(model, tokens, mtp_weight, weights)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": parts["lm"], "mtp_loss": parts["mtp"], "grad_norm": grad_norm, **balancer.step()}


class ExpertBalancer:
    """Counts the tokens each expert receives (training forwards only) and nudges the correction biases.

    Usage: `balancer = ExpertBalancer(model)`; after each optimiser step `stats = balancer.step()`.
    """

    def __init__(self, model: HybridForCausalLM, rate: float = 1e-3):
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, TopkRouter)]
        self.counts = [torch.zeros(r.e_score_correction_bias.shape[0]) for r in self.routers]
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def count(module, inputs, output):
            if module.training:
                _, ids = output
                self.counts[i] += torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts[i].shape[0]).float()
        return count

    @torch.no_grad()
    def step(self) -> dict:
        """Apply the bias update; return load statistics since the last step (max / mean load per layer)."""
        ratios = []
        for router, counts in zip(self.routers, self.counts):
            if counts.sum() == 0:
                continue
            mean = counts.mean()
            router.e_score_correction_bias += self.rate * torch.sign(mean - counts).to(router.e_score_correction_bias)
            ratios.append((counts.max() / mean).item())
            counts.zero_()
        return {"max_over_mean_load": max(ratios) if ratios else None}
