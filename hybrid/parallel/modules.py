"""One rank's model: the modules that differ from the single-process ones, and where the collectives go.

`make_rank_model` takes the rank's model built on meta from `ShardPlan.local_config` (its heads, groups and
widths) and swaps in what the local config cannot express: the rank's routed experts (`MoE.expert_offset`
maps the router's global ids onto them), the vocabulary-parallel embedding and head, and, where one Mamba
group spans several ranks, the gated norm that reduces its variance across them. `attach_collectives` then adds the
all-reduce after every row-parallel output (once per layer: o_proj, out_proj, the dense MLP's down_proj, and
for an MoE layer its whole output, routed experts and shared expert summed first) and the all-gather of the
logits. Forward hooks, as gpt-fast's `tp.py`: the layers' code stays the single-process code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config import ATTENTION, MAMBA, MLP, MOE, HybridConfig
from hybrid.layers.norm import GatedRMSNorm
from hybrid.parallel.comm import Collectives
from hybrid.parallel.plan import ShardPlan
from moe.experts import ExpertBank


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the embedding matrix; the full lookup is the all-reduce of every rank's.

    Shapes: ids [...] int64 (global ids, checked by the model against `num_embeddings`) -> [..., H] in the
    weight's dtype. `num_embeddings`: the full vocabulary.
    """

    def __init__(self, num_embeddings: int, rows: int, first: int, hidden_size: int, comm: Collectives | None):
        super().__init__()
        self.num_embeddings, self.first, self.comm = num_embeddings, first, comm
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        inside = (local >= 0) & (local < self.weight.shape[0])
        if self.weight.shape[0]:
            out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight).masked_fill(~inside[..., None], 0)
        else:
            out = self.weight.new_zeros(*ids.shape, self.weight.shape[1])
        return self.comm.all_reduce(out)


class SplitGroupRMSNorm(GatedRMSNorm):
    """The gated RMSNorm of one rank's part of a Mamba group that spans `span` ranks (n_groups < N, as vLLM's
    Mixer2RMSNormGated): each rank's sum of squares goes into its group's slot of an [..., n_groups] fp32
    vector, one all-reduce sums them, and every rank normalises by its group's mean.

    Shapes: as `GatedRMSNorm` with this rank's `d` channels (d_inner / N).
    """

    def __init__(self, d: int, group: int, n_groups: int, group_size: int, eps: float, comm: Collectives | None):
        super().__init__(d, 1, eps)
        self.group, self.n_groups, self.group_size, self.comm = group, n_groups, group_size, comm

    def forward(self, x: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        g = x.float() * F.silu(z.float())
        slots = g.new_zeros(*g.shape[:-1], self.n_groups)
        slots[..., self.group] = g.square().sum(-1)
        variance = self.comm.all_reduce(slots)[..., self.group, None] / self.group_size
        return (g * torch.rsqrt(variance + self.eps) * self.weight.float()).to(out_dtype)


def make_rank_model(model, config: HybridConfig, plan: ShardPlan):
    """Make `model`, built on meta from `plan.local_config` (`hybrid.loading.build_model`), this rank's model
    (uninitialised, for the loader), in place: the swaps of the module docstring; `model.config` becomes the
    full config, `model.cache_config` the rank's. Collectives are attached after loading
    (`attach_collectives`). Returns `model`."""
    dtype = model.dtype
    model.config, model.cache_config = config, plan.local_config
    H, first = config.hidden_size, plan.vocab[0]
    rows = plan.vocab[1] - plan.vocab[0]
    with torch.device("meta"):
        model.backbone.embeddings = VocabParallelEmbedding(config.vocab_size, rows, first, H, None)
        model.lm_head = nn.Linear(H, rows, bias=False)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.backbone.embeddings.weight
        for block in _blocks(model):
            m = block.mixer
            if block.kind == MOE:
                e0, e1 = plan.experts
                latent = config.moe_latent_size or H
                m.experts = ExpertBank(e1 - e0, latent, config.moe_intermediate_size)
                m.expert_offset = e0
            if block.kind == MAMBA and plan.group_span > 1:
                m.norm = SplitGroupRMSNorm(plan.local_config.d_inner, plan.groups[0], config.n_groups,
                                           config.d_inner // config.n_groups, config.layer_norm_epsilon, None)
    return model.cast(dtype)


def attach_collectives(model, plan: ShardPlan, comm: Collectives) -> None:
    """Give the loaded rank model its collectives (see the module docstring); sets `model.parallel`."""
    model.backbone.embeddings.comm = comm

    def reduce(module, inputs, output):
        return comm.all_reduce(output.contiguous())

    chunk, vocab = plan.vocab_chunk, model.config.vocab_size

    def gather(module, inputs, output):
        pad = chunk - output.shape[-1]
        if pad:
            output = F.pad(output, (0, pad))
        return comm.all_gather(output, dim=-1)[..., :vocab]

    for block in _blocks(model):
        m = block.mixer
        target = {ATTENTION: lambda: m.o_proj, MAMBA: lambda: m.out_proj, MLP: lambda: m.down_proj,
                  MOE: lambda: m}[block.kind]()
        target.register_forward_hook(reduce)
        if isinstance(getattr(m, "norm", None), SplitGroupRMSNorm):
            m.norm.comm = comm
    model.lm_head.register_forward_hook(gather)
    model.parallel = TensorParallel(plan, comm)


class TensorParallel:
    """What a sharded model knows of its place: `plan` (`ShardPlan`), `comm` (`Collectives`, counting its
    traffic) and `read_bytes` (the bytes of the checkpoint's tensors this rank read, set by the loader)."""

    def __init__(self, plan: ShardPlan, comm: Collectives):
        self.plan, self.comm = plan, comm
        self.read_bytes = 0

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world(self) -> int:
        return self.plan.world


def _blocks(model):
    yield from model.backbone.layers
    if model.mtp is not None:
        yield from model.mtp.layers
