"""What training a hybrid model from scratch needs beyond PyTorch: initialisation, the language-model loss
(with the optional MTP term), auxiliary-loss-free expert balancing, and the learning-rate schedule.

- Initialisation follows transformers' NemotronH / mamba-ssm: normal(0, initializer_range) weights, residual
  output projections scaled by 1/sqrt(2 * num_layers) (GPT-2), A = uniform(1, 16) (A_log = log A),
  D = 1, dt_bias = softplus^-1(dt) with dt log-uniform in [time_step_min, time_step_max] (floored at
  time_step_floor), norms 1, biases and the correction bias 0.
- Balancing is DeepSeek-V3's auxiliary-loss-free strategy (Liu et al. 2024, section 2.1.2): after every
  optimiser step, each MoE layer's `e_score_correction_bias` moves by `rate` towards balance,
  `b_i += rate * sign(mean_load - load_i)`. The bias only affects which experts are chosen, never their
  weights, which is exactly how the router uses it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybrid.model import HybridForCausalLM
from moe.router import TopkRouter

_RESIDUAL_OUT = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj", "fc2_latent_proj.weight")


@torch.no_grad()
def init_weights(model: HybridForCausalLM, seed: int) -> None:
    """Initialise every parameter and buffer of `model` in place (see the module docstring)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    residual_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
        elif name.endswith(".D"):
            p.fill_(1.0)
        elif name.endswith("dt_bias"):
            lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
            dt = torch.exp(torch.rand(p.shape, generator=g) * (hi - lo) + lo).clamp(min=config.time_step_floor)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        elif name.endswith(("norm.weight", "norm_f.weight")):
            p.fill_(1.0)
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
        elif name.endswith("bias"):
            p.zero_()
        else:
            scale = residual_scale if name.endswith(_RESIDUAL_OUT) else 1.0
            p.copy_(torch.randn(p.shape, generator=g) * std * scale)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


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
