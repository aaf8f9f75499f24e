"""Shared helpers for the oracle tests: tiny transformers checkpoints with useful random weights, naive
float64 reference computations, and a small greedy loop over our cache.

The main oracle is transformers' `NemotronHForCausalLM`. Its default init is useless for parity tests
(A_log = log(1..nh), D = 1, tiny std 0.02 weights, zero router bias), so every tensor is redrawn here at
a scale where every part of the network moves the logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

import hybrid
from hybrid.cache import Cache, MambaState, StepContext
from hybrid.config import HybridConfig

# Settings shared by every tiny config. `time_step_min` is the trap of docs/semantics.md: transformers'
# prefill clamps dt to >= time_step_min (1e-3) and its decode does not; 1e-9 makes that clamp a no-op.
TINY_DEFAULTS = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    time_step_min=1e-9,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Figures worth reporting (max abs logit differences, bf16 errors); printed by conftest at the end.
REPORT: dict[str, str] = {}

PATTERN_TO_TYPES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def tf_config(pattern: str, **overrides):
    """A transformers `NemotronHConfig` for the layer pattern (M * E -) and the overrides."""
    from transformers import NemotronHConfig

    kwargs = dict(TINY_DEFAULTS)
    kwargs.update(overrides)
    kwargs["layers_block_type"] = [PATTERN_TO_TYPES[c] for c in pattern]
    return NemotronHConfig(**kwargs)


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int, linear_std: float = 0.2) -> None:
    """Redraw every parameter and buffer of a transformers NemotronH model (in place).

    - linears, embeddings, experts, router: normal(0, linear_std) (router a bit larger so routing is decisive)
    - norm weights: 1 + 0.1 * normal
    - A_log = log(uniform(1, 16)); D = normal; dt_bias such that softplus(dt_bias) is in [0.01, 0.5]
    - conv1d weight normal(0, 0.3), conv bias normal(0, 0.1)
    - e_score_correction_bias: normal(0, 0.05)
    """
    g = torch.Generator().manual_seed(seed)

    def normal(t, std, mean=0.0):
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    for name, p in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
        elif name.endswith(".D"):
            normal(p, 1.0)
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.5) - math.log(0.01)) + math.log(0.01))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif name.endswith("conv1d.weight"):
            normal(p, 0.3)
        elif name.endswith("conv1d.bias"):
            normal(p, 0.1)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            normal(p, 0.1, mean=1.0)
        elif name.endswith("gate.weight"):
            normal(p, 0.5)
        else:  # embeddings, every linear, stacked experts
            normal(p, linear_std)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.05)


def make_tf_checkpoint(directory: Path, pattern: str, seed: int = 0, tie_head: bool = False, **overrides):
    """Build, randomise and `save_pretrained` a tiny transformers model. Returns (tf_model fp32 eval, dir).

    With `tie_word_embeddings`, transformers 5.24 does not tie (its `_tied_weights_keys` is empty) and
    saves an independent `lm_head.weight`; `tie_head=True` copies the embeddings into it so that the
    saved checkpoint is a consistent tied model.
    """
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(tf_config(pattern, **overrides)).float().eval()
    randomise_(model, seed)
    if tie_head:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embeddings.weight)
    directory = Path(directory)
    model.save_pretrained(directory)
    return model, directory


def tf_logits(tf_model, ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """Full-sequence fp32 logits from transformers (no cache)."""
    with torch.no_grad():
        out = tf_model(input_ids=ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=0)
    return out.logits.float()


def tf_greedy(tf_model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers `generate(do_sample=False)`: (new tokens [B, n], the logits of each step [B, n, V])."""
    tf_model.generation_config.eos_token_id = None  # never stop early
    with torch.no_grad():
        out = tf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).float()


class Packed:
    """Sequences of different lengths on one paged cache, stepped together, each over its own blocks and state
    slot (the engine's path without its scheduler): `step` runs one packed forward."""

    def __init__(self, model, n: int, capacity: int = 256, block_size: int = 16):
        from hybrid.serving.blocks import BlockPool
        from hybrid.serving.paged_cache import PagedCache
        from hybrid.serving.slots import StateSlots

        config, per = model.cache_config, -(-capacity // block_size)
        self.model, self.lengths = model, [0] * n
        self.blocks = BlockPool(config, n * per, block_size, model.dtype, model.device)
        self.slots = StateSlots(config, n, model.dtype, model.device)
        self.rows = [([self.blocks.allocate() for _ in range(per)], self.slots.allocate()) for _ in range(n)]
        self.cache = PagedCache(config, self.blocks, self.slots)

    @torch.no_grad()
    def step(self, tokens: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's new tokens (a non-empty id list each) in one packed forward; each one's logits [n_i, V]."""
        from hybrid.serving.paged_cache import ScheduledSeq

        self.cache.schedule([ScheduledSeq(*self.rows[i], self.lengths[i], len(t)) for i, t in enumerate(tokens)])
        logits = self.model(torch.tensor([[x for t in tokens for x in t]], device=self.model.device), self.cache)[0]
        for i, t in enumerate(tokens):
            self.lengths[i] += len(t)
        return list(logits.split([len(t) for t in tokens]))


@torch.no_grad()
def our_greedy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding on our cache: one prefill, then one token per forward. Returns (tokens, step logits)."""
    cache = model.new_cache(ids.shape[0])
    logits = model(ids, cache=cache)[:, -1]
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits)
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.stack(tokens, 1), torch.stack(steps, 1)


def greedy_all_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding on our cache; every position's logits: (batch, prompt + steps, vocab), float32, on the CPU.

    Unlike `our_greedy` (the steps' last-position logits only), the prompt's logits are kept too, so a
    comparison covers the chunked prefill as well as the decode steps."""
    cache = model.new_cache(ids.shape[0])
    out = [model(ids, cache)]
    for _ in range(steps):
        out.append(model(out[-1][:, -1:].argmax(-1), cache))
    return torch.cat(out, dim=1).float().cpu()


def assert_same_greedy(ours: torch.Tensor, ref: torch.Tensor, ref_logits: torch.Tensor, tie_gap: float = 1e-4):
    """Greedy token sequences must be identical; the only excuse for a divergence is a genuine near-tie
    (top-2 gap < tie_gap) in the reference logits at the first differing step."""
    excused = 0
    for row in range(ref.shape[0]):
        diff = (ours[row] != ref[row]).nonzero()
        if len(diff) == 0:
            continue
        excused += 1
        step = int(diff[0])
        top2 = ref_logits[row, step].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie_gap, (
            f"row {row}: greedy tokens diverge at step {step} (ours {ours[row, step].item()}, "
            f"reference {ref[row, step].item()}) with a reference top-2 gap of {gap:.3g}\n"
            f"ours {ours[row].tolist()}\nref  {ref[row].tolist()}"
        )
    if excused:
        REPORT["greedy divergences excused by a reference near-tie"] = str(
            int(REPORT.get("greedy divergences excused by a reference near-tie", "0")) + excused)


def random_ids(n: int, vocab: int, seed: int, batch: int = 1, low: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, n), generator=g)


# ------------------------------------------------------------------------------------------------------
# A standalone Mamba-2 mixer of ours with random weights, and its naive float64 reference.
# ------------------------------------------------------------------------------------------------------

def mamba_config(**overrides) -> HybridConfig:
    """A HybridConfig holding one Mamba layer (tiny sizes)."""
    d = dict(hybrid_override_pattern="M", vocab_size=32, hidden_size=16, mamba_num_heads=4, mamba_head_dim=4,
             ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, torch_dtype="float32")
    d.update(overrides)
    return HybridConfig(**d)


@torch.no_grad()
def random_mixer(config: HybridConfig, seed: int, dt_range=(0.01, 0.5), A_range=(1.0, 16.0), dtype=torch.float32):
    """Our `Mamba2Mixer` with random weights; A_log/D/dt_bias stay fp32 as in a loaded model."""
    from hybrid.layers.mamba2 import Mamba2Mixer

    g = torch.Generator().manual_seed(seed)
    mixer = Mamba2Mixer(config)
    for name, p in mixer.named_parameters():
        if name == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * (A_range[1] - A_range[0]) + A_range[0]))
        elif name == "dt_bias":
            lo, hi = dt_range
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(hi) - math.log(lo)) + math.log(lo))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name == "norm.weight":
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name == "D":
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.startswith("conv1d"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    mixer.eval()
    if dtype != torch.float32:
        for name, p in mixer.named_parameters():
            if name not in ("A_log", "D", "dt_bias"):
                p.data = p.data.to(dtype)
    return mixer


def new_mamba_state(config: HybridConfig, batch: int, dtype=torch.float32) -> MambaState:
    return MambaState(
        conv=torch.zeros(batch, config.conv_dim, config.conv_kernel - 1, dtype=dtype),
        ssm=torch.zeros(batch, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size),
    )


class StateRows:
    """A Mamba mixer's cache handle over a `MambaState` of B rows, sequence s in row s: the protocol of the
    engine's paged cache (`seq`, `rows`) without its pools."""

    def __init__(self, state: MambaState):
        self.state = state

    def seq(self, s: int) -> MambaState:
        return MambaState(conv=self.state.conv[s:s + 1], ssm=self.state.ssm[s:s + 1])

    def rows(self, seqs):
        return self.state.conv, self.state.ssm, torch.tensor(list(seqs), dtype=torch.long)


def run_mixer(mixer, x: torch.Tensor, state: MambaState | None = None, past: int = 0, mask=None) -> torch.Tensor:
    """Our mixer on x [B, T, H]: without a state, from the zero state (padding `mask` allowed); with one, the rows
    as packed sequences continuing `state` (updated in place), as a cached forward runs them."""
    from hybrid.cache import PackedSeqs

    with torch.no_grad():
        if state is None:
            return mixer(x, StepContext(past=past, mask=mask, key_mask=mask), None)
        if mask is not None:
            raise ValueError("a cached forward takes no padding")
        B, T, H = x.shape
        ctx = StepContext(past=0, mask=None, key_mask=None, packed=PackedSeqs([T] * B, [past] * B))
        return mixer(x.reshape(1, B * T, H), ctx, StateRows(state)).reshape(B, T, -1)


def naive_mamba_mixer(mixer, x: torch.Tensor, dt_limit=(0.0, math.inf), conv_window=None, ssm_state=None,
                      tiled_groups: bool = False, norm_groups: int | None = None):
    """Float64 reference of one Mamba-2 mixer, written from docs/semantics.md with plain loops:
    per-position causal conv, per-head sequential recurrence S_t = exp(dt A) S + dt x B^T, y = S C + D x,
    then y * silu(z), RMSNorm over each of the n_groups slices separately, times norm.weight, out_proj.

    Returns (out [B, T, H] float64, final conv window [B, conv_dim, K-1], final SSM state [B, nh, P, N]).
    The two flags build the known-wrong variants, to show a test can tell them apart: `tiled_groups` maps
    head h to group h % ng (`repeat` instead of `repeat_interleave`), `norm_groups` normalises over
    another number of slices (1 = the whole d_inner vector).
    """
    f64 = lambda t: t.detach().to(torch.float64)
    nh, P, ng, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    d_inner, conv_dim, K = mixer.d_inner, mixer.conv_dim, mixer.conv_kernel
    Bsz, T, _ = x.shape
    zxbcdt = f64(x) @ f64(mixer.in_proj.weight).T
    if mixer.in_proj.bias is not None:
        zxbcdt = zxbcdt + f64(mixer.in_proj.bias)
    z, xBC, dt_raw = zxbcdt.split([d_inner, conv_dim, nh], dim=-1)

    # causal depthwise conv: out_t = sum_k w[k] * in_{t-(K-1)+k}, over the window then the new inputs
    window = torch.zeros(Bsz, conv_dim, K - 1, dtype=torch.float64) if conv_window is None else f64(conv_window)
    seq = torch.cat([window, xBC.transpose(1, 2)], dim=-1)  # [B, c, K-1+T]
    w = f64(mixer.conv1d.weight)[:, 0]  # [c, K]
    bias = f64(mixer.conv1d.bias) if mixer.conv1d.bias is not None else torch.zeros(conv_dim, dtype=torch.float64)
    conv = torch.stack([(seq[:, :, t : t + K] * w).sum(-1) + bias for t in range(T)], dim=1)  # [B, T, c]
    conv = F.silu(conv)
    xs, Bm, Cm = conv.split([d_inner, ng * N, ng * N], dim=-1)

    A = -torch.exp(f64(mixer.A_log))
    D = f64(mixer.D)
    dt = F.softplus(dt_raw + f64(mixer.dt_bias)).clamp(*dt_limit)  # [B, T, nh]
    S = torch.zeros(Bsz, nh, P, N, dtype=torch.float64) if ssm_state is None else f64(ssm_state).clone()
    y = torch.zeros(Bsz, T, nh, P, dtype=torch.float64)
    heads_per_group = nh // ng
    for b in range(Bsz):
        for h in range(nh):
            grp = h % ng if tiled_groups else h // heads_per_group  # contiguous groups (docs/cases.md case 2)
            for t in range(T):
                x_t = xs[b, t, h * P : (h + 1) * P]
                B_t = Bm[b, t, grp * N : (grp + 1) * N]
                C_t = Cm[b, t, grp * N : (grp + 1) * N]
                S[b, h] = torch.exp(dt[b, t, h] * A[h]) * S[b, h] + dt[b, t, h] * torch.outer(x_t, B_t)
                y[b, t, h] = S[b, h] @ C_t + D[h] * x_t
    y = y.reshape(Bsz, T, d_inner) * F.silu(z)
    n_norm = ng if norm_groups is None else norm_groups
    groups = y.view(Bsz, T, n_norm, d_inner // n_norm)
    groups = groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)
    y = groups.reshape(Bsz, T, d_inner) * f64(mixer.norm.weight)
    out = y @ f64(mixer.out_proj.weight).T
    if mixer.out_proj.bias is not None:
        out = out + f64(mixer.out_proj.bias)
    return out, seq[:, :, -(K - 1):], S


def load_ours(directory, dtype=torch.float32):
    return hybrid.load_model(directory, dtype=dtype)


class InterfaceOnly(Cache):
    """A `Cache` that offers only the interface's methods, each forwarded to a `BatchCache` and counted: code
    that runs on it uses the interface and nothing of the implementation (`blocks`, `slots` ...)."""

    def __init__(self, inner: Cache):
        self.inner, self.calls = inner, {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self.inner, name)

    batch_size = property(lambda self: self.inner.batch_size)
    seq_len = property(lambda self: self.inner.seq_len)

    def begin(self, *args, **kwargs):
        return self._count("begin")(*args, **kwargs)

    def layer(self, i):
        return self._count("layer")(i)

    def snapshot_kv(self, row, start, end):
        return self._count("snapshot_kv")(row, start, end)

    def snapshot_mamba(self, row):
        return self._count("snapshot_mamba")(row)
