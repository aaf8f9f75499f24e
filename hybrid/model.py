"""The hybrid stack: embeddings, pre-norm blocks from the layer pattern, final norm, LM head; the MTP block.

    h = embeddings[input_ids]
    for each layer: h = h + mixer(RMSNorm(h))        mixer by pattern character: M Mamba-2, * attention,
                                                     E MoE, - dense MLP
    hidden = norm_f(h)                               `hidden_states`
    logits = lm_head(hidden).float()                 `logits`: the one place hidden states become logits

Module names mirror the published tensor names (`backbone.layers.{i}.mixer...`, `lm_head`, `mtp.layers.{j}`),
so loading is a direct mapping (reference: transformers `NemotronHForCausalLM`). The model declares its
quantization (`quantization`, `act_quant`) and knows its identity (`identity`, `hybrid.fingerprint`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import hybrid.fingerprint as fingerprint
from hybrid.batch import outside_vocabulary
from hybrid.cache import Cache, MambaState, StepContext
from hybrid.config import ATTENTION, MAMBA, MLP as MLP_CHAR, MOE, HybridConfig
from hybrid.layers.attention import Attention
from hybrid.layers.mamba2 import Mamba2Mixer
from hybrid.layers.mlp import MLP
from hybrid.layers.moe import MoE
from hybrid.layers.norm import RMSNorm
from moe.quant import PackedExperts, PackedWeight, Prepacked
from moe.quant.config import QuantConfig

# Parameters held in fp32 whatever the model dtype: the router (transformers keeps `gate.weight` and the
# correction bias in fp32) and the per-head SSM parameters (tiny; bf16 values upcast exactly).
# KV-cache scales of quantized checkpoints (`k_proj.k_scale`, `v_proj.v_scale`) are fp32 scalars too.
FP32_SUFFIXES = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias", ".mixer.A_log", ".mixer.D", ".mixer.dt_bias",
                 ".k_scale", ".v_scale")


def make_mixer(kind: str, config: HybridConfig) -> nn.Module:
    """The mixer module for one pattern character."""
    if kind == MAMBA:
        return Mamba2Mixer(config)
    if kind == ATTENTION:
        return Attention(config)
    if kind == MOE:
        return MoE(config)
    if kind == MLP_CHAR:
        return MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
    raise ValueError(f"unknown layer kind {kind!r}")


class Block(nn.Module):
    """One pre-norm residual layer: `h + mixer(norm(h))`. Shapes: [B, T, H] -> [B, T, H]."""

    def __init__(self, kind: str, config: HybridConfig):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = make_mixer(kind, config)

    def forward(self, h: torch.Tensor, ctx: StepContext | None, state=None) -> torch.Tensor:
        """`state`: this layer's handle from `Cache.layer` (attention and Mamba layers), or None."""
        x = self.norm(h)
        if self.kind in (MAMBA, ATTENTION):
            return h + self.mixer(x, ctx, state)
        return h + self.mixer(x)


class Backbone(nn.Module):
    """`backbone.*`: embeddings, the blocks, the final norm."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        # built uninitialised (`build_model`): nn.Embedding's own normal_ init on the meta device imports
        # torch._dynamo, a cost on every load (docs/perf-log.md#embedding-uninit); the weights are always loaded
        # or initialised next
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                       _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Block(kind, config) for kind in config.hybrid_override_pattern)
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class MTPLayer(Block):
    """One layer of the multi-token-prediction block (`mtp.layers.{j}`).

    The first layer also holds `enorm`, `hnorm` and `eh_proj [H, 2H]`; the last one `final_layernorm`.
    """

    def __init__(self, kind: str, config: HybridConfig, first: bool, last: bool):
        super().__init__(kind, config)
        H, eps = config.hidden_size, config.layer_norm_epsilon
        if first:
            self.enorm = RMSNorm(H, eps)
            self.hnorm = RMSNorm(H, eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        if last:
            self.final_layernorm = RMSNorm(H, eps)


class MTP(nn.Module):
    """The MTP block (`mtp.layers.*`, pattern `mtp_pattern`), used only to draft tokens.

    `h = eh_proj(cat([enorm(embed(next_tokens)), hnorm(prev_hidden)], -1))`, then the pre-norm layers, then
    `final_layernorm`; the model's `logits` applies the shared `lm_head`. `prev_hidden` is the main model's
    output after `norm_f` (the hidden state its `lm_head` reads), as vLLM's NemotronH MTP receives it; from
    hidden state t and token t+1 the block predicts token t+2.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        if config.num_nextn_predict_layers != 1:
            raise ValueError(
                f"`num_nextn_predict_layers` is {config.num_nextn_predict_layers}; only 0 or 1 MTP module is supported"
            )
        n = len(config.mtp_pattern)
        self.layers = nn.ModuleList(
            MTPLayer(kind, config, first=j == 0, last=j == n - 1) for j, kind in enumerate(config.mtp_pattern)
        )

    def forward(self, prev_hidden: torch.Tensor, next_embeds: torch.Tensor, ctx: StepContext | None = None,
                cache: Cache | None = None) -> torch.Tensor:
        """prev_hidden, next_embeds: [B, T, H] -> [B, T, H] after `final_layernorm` (the model's `logits` next).
        `cache`: the block's own (`HybridForCausalLM.mtp_hidden_states`), or None."""
        first = self.layers[0]
        h = first.eh_proj(torch.cat([first.enorm(next_embeds), first.hnorm(prev_hidden)], dim=-1))
        for j, layer in enumerate(self.layers):
            h = layer(h, ctx, cache.layer(j) if cache is not None else None)
        return self.layers[-1].final_layernorm(h)


class HybridForCausalLM(nn.Module):
    """A Nemotron-H style hybrid language model.

    Call: `model(input_ids [B, T] int64, cache=None, attention_mask=None, logits_to_keep=0)` ->
    logits [B, T, vocab_size] float32 (only the last `logits_to_keep` positions when it is > 0).
    `attention_mask` marks real tokens (1) and padding (0), [B, T], for a forward without a cache; on a cache
    (`new_cache`, updated in place) only all-real masks are taken, [B, T] or [B, past + T] as transformers
    passes them (prompts of different lengths run as packed sequences: `hybrid.generate_ids`).

    Attributes:
        quantization: the `moe.quant.config.QuantConfig` the packed modules follow, or None (float weights).
        act_quant: packed matmuls quantize-dequantize their inputs (W8A8 / W4A4 emulation).
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.mtp = MTP(config) if config.num_nextn_predict_layers else None
        self.quantization: QuantConfig | None = None
        self.act_quant = False
        self._weights_digest: str | None = None
        self.cache_config = config  # the sizes of this process's caches: a rank's under tensor parallelism
        self.parallel = None  # `hybrid.parallel.TensorParallel` of a sharded model (`hybrid.load(tensor_parallel=N)`)

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.backbone.embeddings.weight.device

    # ------------------------------------------------------------------------------------------ identity
    @property
    def identity(self) -> str:
        """A hex digest naming this model's numbers (`hybrid.fingerprint`): config, dtype, quantization,
        act_quant, the rank and world size of a tensor-parallel shard, and every byte of every weight. The weights' part is taken on first use from the current
        tensors (reading all of them once) and kept; `load_state_dict`, `cast` and quantization forget it, and
        after editing weights in place call `reset_identity`."""
        if self._weights_digest is None:
            self._weights_digest = fingerprint.weights_digest(self.weight_pieces())
        config = dataclasses.replace(self.config, quantization_config=None).to_dict()  # the quantization: below
        if self.parallel is not None:  # a rank's shard: its caches and files are its own
            config["tensor_parallel"] = {"rank": self.parallel.rank, "world": self.parallel.world}
        quant = None if self.quantization is None else self.quantization.files
        return fingerprint.identity(config, self.dtype, quant, self.act_quant, self._weights_digest)

    def reset_identity(self) -> None:
        """Forget the weights' digest (after the weights changed in place); the next `identity` retakes it."""
        self._weights_digest = None

    def weight_pieces(self):
        """(name, shape, dtype, pieces) of every state-dict tensor, in its order: `pieces` yields the tensor
        itself, or for a prepacked module its dense form in row-major slices (an expert bank one expert at a
        time, never stacked; packed weights `PackedWeight.tensor_pieces`), each read only when the caller
        iterates it."""
        for mname, module in self.named_modules():
            prefix = f"{mname}." if mname else ""
            if isinstance(module, Prepacked):
                for n, shape, pieces in module.dense_pieces():
                    yield prefix + n, shape, torch.bfloat16, pieces
            if isinstance(module, PackedWeight):
                yield from ((prefix + n, shape, dtype, pieces) for n, shape, dtype, pieces in module.tensor_pieces())
            buffers = [] if isinstance(module, PackedWeight) else module.named_buffers(recurse=False)
            for n, t in [*module.named_parameters(recurse=False), *buffers]:
                yield prefix + n, tuple(t.shape), t.dtype, (t,)

    def named_tensors(self):
        """The state dict's (name, tensor) pairs, in its order, one module at a time (a prepacked module's
        dense copies and a `PackedExperts`' stacks one tensor at a time, never all at once)."""
        for mname, module in self.named_modules():
            prefix = f"{mname}." if mname else ""
            if isinstance(module, Prepacked):
                yield from ((prefix + n, t) for n, t in module.dense_tensors())
            if isinstance(module, PackedExperts):
                yield from ((prefix + n, torch.stack(list(pieces))) for n, _, _, pieces in module.tensor_pieces())
            yield from ((prefix + n, t) for n, t in module.named_parameters(recurse=False))
            yield from ((prefix + n, t) for n, t in module.named_buffers(recurse=False))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`, forgetting the weights' digest of `identity` (retaken on its next use)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.reset_identity()
        return result

    def cast(self, dtype: torch.dtype) -> "HybridForCausalLM":
        """Convert floating-point weights to `dtype`, keeping the `FP32_SUFFIXES` tensors in fp32.

        The buffers of packed modules (`moe.quant.PackedWeight`: E4M3 weights, packed bytes, fp32 scales)
        keep their stored dtypes; the model dtype is their compute dtype.
        """
        for mname, module in self.named_modules():
            tensors = list(module.named_parameters(recurse=False))
            if not isinstance(module, PackedWeight):
                tensors += list(module.named_buffers(recurse=False))
            for tname, t in tensors:
                name = f"{mname}.{tname}" if mname else tname
                want = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
                if t.is_floating_point() and t.dtype != want:
                    t.data = t.data.to(want)
        self.reset_identity()
        return self

    # ------------------------------------------------------------------------------------------ caches
    def new_cache(self, batch_size: int, capacity: int = 0) -> "BatchCache":
        """An empty inference state for running `batch_size` sequences step by step through `forward` (KV blocks
        for `capacity` positions each allocated up front; the pool grows past them): the serving engine's paged
        cache (`hybrid.serving.paged_cache.BatchCache`). Every forward on it brings the same number of tokens to
        every sequence; prompts of different lengths run on `hybrid.generate_ids` or the engine."""
        from hybrid.serving.paged_cache import BatchCache

        return BatchCache(self.cache_config, batch_size, self.dtype, self.device, capacity)

    # ------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
    ):
        """Logits [B, T, V] float32 (or the last `logits_to_keep` positions).

        return_hidden: also return the normalised hidden states [B, T, H] that `lm_head` reads (the
            input of the MTP block), as `(logits, hidden)`.
        Raises:
            ValueError: see `hidden_states` (e.g. a token id outside the vocabulary, named with its position).
        """
        h = self.hidden_states(input_ids, cache, attention_mask)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.logits(h)
        return (logits, h) if return_hidden else logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] float32 from normalised hidden states [..., H]: the main stack's (`hidden_states`)
        or the MTP block's output."""
        return self.lm_head(hidden).float()

    def hidden_states(
        self, input_ids: torch.Tensor, cache: Cache | None = None, attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The normalised output of the stack, `norm_f(h)`: [B, T, hidden_size] in the model dtype (what
        `logits` and the MTP block read). Padded positions (False in `attention_mask`) may hold any id: they
        never reach the embedding. `input_ids` may lie on the CPU for a model on another device (the engine's:
        they are checked there, with no read back from the device, then copied).

        Raises:
            ValueError: input_ids not [batch, tokens] of integers or with no tokens, a real token id outside
                [0, vocab_size), an attention_mask of the wrong shape or with values other than 0 / 1, padding
                on a cache, or a batch size other than the cache's.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0 or B == 0:
            raise ValueError(f"input_ids has no tokens (shape {tuple(input_ids.shape)}); a forward needs at least "
                             "one token per row")
        mask = self._token_mask(attention_mask, B, T, cache)
        ids = input_ids if mask is None else input_ids.masked_fill(~mask, 0)
        self._check_ids(ids)  # before the cache advances; where the ids are (a caller's host ids: no device read)
        ids, mask = ids.to(self.device), None if mask is None else mask.to(self.device)
        ctx = cache.begin(B, T, mask) if cache is not None else StepContext(past=0, mask=mask, key_mask=mask)
        flat = ctx.packed is not None and B > 1  # a batch cache's rows: packed one after another
        h = self.backbone.embeddings(ids.reshape(1, B * T) if flat else ids)
        for i, block in enumerate(self.backbone.layers):
            h = block(h, ctx, cache.layer(i) if cache is not None else None)
        h = self.backbone.norm_f(h)
        return h.reshape(B, T, -1) if flat else h

    def mtp_hidden_states(self, hidden: torch.Tensor, next_ids: torch.Tensor, mtp_cache: Cache) -> torch.Tensor:
        """Run the MTP block over new positions on its cache (the engine's: `PagedCache(..., mtp=True)`).

        hidden: [B, T, H] normalised hidden states (the main model's, from `hidden_states`, or the block's own
        output when drafting recursively); next_ids: [B, T] the token after each position. Returns the block's
        output [B, T, H] (`logits` of it: the token after `next_ids`)."""
        ctx = mtp_cache.begin(next_ids.shape[0], next_ids.shape[1], None)
        return self.mtp(hidden, self.backbone.embeddings(next_ids), ctx, mtp_cache)

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the token after `next_ids` from the MTP block, without a cache (training, tests).

        hidden: [B, T, H] the main model's normalised output (`hidden_states(...)`);
        next_ids: [B, T] the token that follows each position. Returns [B, T, V] float32.
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP block (num_nextn_predict_layers is 0)")
        return self.logits(self.mtp(hidden, self.backbone.embeddings(next_ids), StepContext(past=0, mask=None, key_mask=None)))

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Refuse ids the embedding cannot look up (torch would fail deep inside with "index out of range");
        one reduction over the batch."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got {ids.dtype}")
        vocab = self.backbone.embeddings.num_embeddings
        outside = (ids < 0) | (ids >= vocab)
        if bool(outside.any()):
            row, col = outside.nonzero()[0].tolist()
            raise ValueError(outside_vocabulary(int(ids[row, col]), f"input_ids[{row}, {col}]", vocab))

    @staticmethod
    def _token_mask(attention_mask, B: int, T: int, cache: Cache | None) -> torch.Tensor | None:
        """The [B, T] bool mask of real new tokens, or None when all are real."""
        if attention_mask is None:
            return None
        past = cache.seq_len if cache is not None else 0
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in (T, past + T):
            raise ValueError(
                f"attention_mask must be [batch, new tokens] = [{B}, {T}] or [batch, past + new] = [{B}, {past + T}], "
                f"got {tuple(attention_mask.shape)}"
            )
        if attention_mask.dtype != torch.bool:
            if attention_mask.dtype.is_complex:
                raise ValueError(f"attention_mask must hold only 0 and 1 (or True and False), got {attention_mask.dtype}")
            bad = (attention_mask != 0) & (attention_mask != 1)
            if bool(bad.any()):
                value = attention_mask[bad][0].item()
                raise ValueError(f"attention_mask must hold only 0 and 1 (or True and False), got {value!r} "
                                 f"(attention_mask[{', '.join(map(str, bad.nonzero()[0].tolist()))}])")
        mask = attention_mask[:, -T:].bool()
        return None if bool(mask.all()) else mask
