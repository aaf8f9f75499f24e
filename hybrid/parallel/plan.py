"""Which part of every tensor one rank holds under tensor parallelism: the sharding plan, from the config alone.

Megatron-style tensor parallelism over N ranks (Shoeybi et al. 2019; the layouts of vLLM's NemotronH and of
gpt-fast's `tp.py`), with expert parallelism for the routed experts (DeepSeek-V3's reference inference):

    attention   q/k/v by heads (column-parallel; KV heads replicated when N exceeds them), o_proj by its input
                columns (row-parallel: one all-reduce)
    Mamba-2     in_proj rows [z | x | B | C | dt], conv channels [x | B | C], dt_bias / A_log / D and the gated
                norm by heads; B and C by groups (a group's B and C replicated on the N / n_groups ranks of its
                heads when N exceeds n_groups); out_proj row-parallel
    MLP         dense layers and the shared expert: up_proj by rows, down_proj by columns
    experts     rank r holds experts [r E/N, (r+1) E/N) whole; every rank routes every token
    vocabulary  embeddings and lm_head by rows, ceil(V / N) per rank (the last rank may hold fewer)
    the rest    replicated: norms, the router, latent projections, the MTP block's `eh_proj`

A row-parallel bias is held by rank 0 only (zeros elsewhere), so the all-reduce adds it once. `Shard` says how
one checkpoint tensor is cut; `ShardPlan.shard(name)` gives it for every state-dict name, and
`ShardPlan.local_config` the per-rank sizes the rank's modules and caches are built from.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from hybrid.config import ATTENTION, MAMBA, MLP, MOE, ConfigError, HybridConfig
from moe.quant.config import QuantConfig


@dataclass(frozen=True)
class Shard:
    """How one rank's part of a tensor is taken from the full tensor.

    kind: "replicate" (the whole tensor), "split" (the `ranges` along `dim`, concatenated in order) or
        "rank0" (the whole tensor on rank 0, zeros on the others: a row-parallel bias).
    """

    kind: str
    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind != "split":
            return tuple(shape)
        out = list(shape)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)


REPLICATE = Shard("replicate")
RANK0 = Shard("rank0")


def even_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s part of `n` items split in `world` contiguous parts of ceil(n / world) (the last ones
    shorter, possibly empty): the vocabulary, whose logits are gathered in parts of one size."""
    step = -(-n // world)
    return min(rank * step, n), min((rank + 1) * step, n)


def block_range(n: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s part of `n` items cut in ceil(n / unit) blocks of `unit` (the last one shorter), the blocks
    dealt out as evenly as contiguous parts allow (rank r: blocks [r B / N, (r + 1) B / N)): the dense MLP and
    shared-expert widths, in blocks of the packed weights' scale blocks (`width_units`; 1 when not packed).
    A rank's part is empty only when there are fewer blocks than ranks (`ShardPlan` refuses that)."""
    blocks = -(-n // unit)
    return min(rank * blocks // world * unit, n), min((rank + 1) * blocks // world * unit, n)


class ShardPlan:
    """The parts of `config`'s tensors that rank `rank` of `world` holds.

    Attributes:
        heads, kv_heads: this rank's attention query / KV head ranges.
        mamba_heads, groups: this rank's Mamba head range and its B/C group range.
        group_span: ranks sharing one Mamba group (N / n_groups when N exceeds n_groups, else 1); above 1
            the gated norm reduces its variance across them.
        experts: this rank's routed expert range; vocab: its vocabulary row range (`vocab_chunk` rows each).
        local_config: the config of this rank's modules and caches (heads, groups and widths per rank; the
            vocabulary and `n_routed_experts` stay global: the router scores every expert).
        quant: the checkpoint's quantization config (None: unquantized). Packed weights split at whole scale
            blocks: the dense MLP and shared-expert widths in whole blocks of their projections (`width_units`,
            `block_range`), and `o_proj` / `out_proj` only where each rank's input columns are whole blocks.
            Row splits that cut a block are `hybrid.parallel.packed`'s.
    Raises:
        ConfigError: sizes that do not split `world` ways, naming every field that does not and its rule (query
            heads, Mamba heads and routed experts must be multiples of N; KV heads and n_groups multiples or
            divisors of N; each rank's input columns of a packed row-parallel weight whole scale blocks, and a
            packed MLP width at least N blocks), and the numbers of ranks (up to 64) that would split.
    """

    def __init__(self, config: HybridConfig, rank: int, world: int, quant: QuantConfig | None = None):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"tensor_parallel rank {rank} of {world}: expected 0 <= rank < world >= 1")
        self.config, self.rank, self.world, self.quant = config, rank, world, quant
        kinds = set(config.hybrid_override_pattern)
        if config.num_nextn_predict_layers:
            kinds |= set(config.mtp_pattern)
        self._check(config, kinds, world, quant)
        N, r = world, rank
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        self.heads = (r * nq // N, (r + 1) * nq // N)
        kv = r // (N // nkv) if N >= nkv else None
        self.kv_heads = (kv, kv + 1) if kv is not None else (r * nkv // N, (r + 1) * nkv // N)
        nh, G = config.mamba_num_heads, config.n_groups
        self.mamba_heads = (r * nh // N, (r + 1) * nh // N)
        self.group_span = N // G if N > G else 1
        g0 = r // self.group_span if N > G else r * G // N
        self.groups = (g0, g0 + (1 if N > G else G // N))
        E = config.n_routed_experts
        self.experts = (r * E // N, (r + 1) * E // N)
        self.vocab_chunk = -(-config.vocab_size // N)
        self.vocab = even_range(config.vocab_size, N, r)
        self.width_units = width_units(config, quant)
        self.mlp = block_range(config.intermediate_size, N, r, self.width_units["mlp"])
        self.shared = block_range(config.moe_shared_expert_intermediate_size, N, r, self.width_units["shared"])
        self.local_config = dataclasses.replace(
            config,
            num_attention_heads=_n(self.heads), num_key_value_heads=_n(self.kv_heads),
            mamba_num_heads=_n(self.mamba_heads), n_groups=_n(self.groups),
            intermediate_size=_n(self.mlp), moe_shared_expert_intermediate_size=_n(self.shared),
        )

    @classmethod
    def _check(cls, config: HybridConfig, kinds: set[str], N: int, quant: QuantConfig | None = None) -> None:
        problems = cls._problems(config, kinds, N, quant)
        if problems:
            fits = [n for n in range(1, 65) if not cls._problems(config, kinds, n, quant)]
            raise ConfigError(f"tensor_parallel={N}: " + "; ".join(problems)
                              + f" (this config splits over {', '.join(map(str, fits))} ranks)")

    @staticmethod
    def _problems(config: HybridConfig, kinds: set[str], N: int, quant: QuantConfig | None = None) -> list[str]:
        """What stops `config` from splitting N ways (empty: it splits)."""
        problems = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        if ATTENTION in kinds:
            nq, nkv = config.num_attention_heads, config.num_key_value_heads
            need(nq % N == 0, f"`num_attention_heads` ({nq}) is not a multiple of {N}: query heads are split evenly")
            need(nkv % N == 0 or N % nkv == 0, f"`num_key_value_heads` ({nkv}) must be a multiple or a divisor of {N} "
                 "(KV heads are split, or replicated when ranks exceed them)")
        if MAMBA in kinds:
            nh, G = config.mamba_num_heads, config.n_groups
            need(nh % N == 0, f"`mamba_num_heads` ({nh}) is not a multiple of {N}: Mamba heads are split evenly")
            need(G % N == 0 or N % G == 0, f"`n_groups` ({G}) must be a multiple or a divisor of {N}: each rank's "
                 "heads must lie in whole groups, or one group's heads span whole ranks")
        if MOE in kinds:
            E = config.n_routed_experts
            need(E % N == 0, f"`n_routed_experts` ({E}) is not a multiple of {N}: each rank holds E / N experts")
        need(config.vocab_size >= N, f"`vocab_size` ({config.vocab_size}) is smaller than the number of ranks")
        if quant is not None and not problems:
            problems += _packed_problems(config, N, quant)
        return problems

    # ------------------------------------------------------------------------------------------ shards
    def shard(self, name: str, kind: str | None) -> Shard:
        """How this rank takes tensor `name` (a state-dict name; per-expert checkpoint names are mapped by
        `hybrid.parallel.files`) of a layer of `kind` (its pattern character, None outside the layers)."""
        leaf = name.rpartition(".mixer.")[2] if ".mixer." in name else name
        if name in ("backbone.embeddings.weight", "lm_head.weight"):
            return Shard("split", 0, (self.vocab,))
        if kind == ATTENTION:
            return self._attention(leaf)
        if kind == MAMBA:
            return self._mamba(leaf)
        if kind == MLP and leaf.startswith(("up_proj.", "down_proj.")):
            return self._mlp(leaf, self.mlp)
        if kind == MOE:
            if leaf.startswith("shared_experts."):
                return self._mlp(leaf.removeprefix("shared_experts."), self.shared)
            if leaf.split(".")[:2] in (["experts", "up_proj"], ["experts", "down_proj"]):  # a stack, any tensor
                return Shard("split", 0, (self.experts,))
            if leaf == "fc2_latent_proj.bias":  # applied to the partial (local experts') sum
                return RANK0
        return REPLICATE

    def _attention(self, leaf: str) -> Shard:
        hd = self.config.head_dim
        q = (self.heads[0] * hd, self.heads[1] * hd)
        kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        return {"q_proj.weight": Shard("split", 0, (q,)), "q_proj.bias": Shard("split", 0, (q,)),
                "k_proj.weight": Shard("split", 0, (kv,)), "k_proj.bias": Shard("split", 0, (kv,)),
                "v_proj.weight": Shard("split", 0, (kv,)), "v_proj.bias": Shard("split", 0, (kv,)),
                "o_proj.weight": Shard("split", 1, (q,)), "o_proj.bias": RANK0}.get(leaf, REPLICATE)

    def _mamba(self, leaf: str) -> Shard:
        c = self.config
        P, S, d_inner, GS = c.mamba_head_dim, c.ssm_state_size, c.d_inner, c.n_groups * c.ssm_state_size
        h0, h1 = self.mamba_heads
        g0, g1 = self.groups
        x = (h0 * P, h1 * P)
        bc = ((d_inner + g0 * S, d_inner + g1 * S), (d_inner + GS + g0 * S, d_inner + GS + g1 * S))
        xbc = (x, *bc)  # the conv channels [x | B | C]
        dt = (d_inner + c.conv_dim + h0, d_inner + c.conv_dim + h1)
        rows = (x, *((a + d_inner, b + d_inner) for a, b in xbc), dt)  # in_proj: [z | x B C | dt]
        return {"in_proj.weight": Shard("split", 0, rows), "in_proj.bias": Shard("split", 0, rows),
                "conv1d.weight": Shard("split", 0, xbc), "conv1d.bias": Shard("split", 0, xbc),
                "dt_bias": Shard("split", 0, ((h0, h1),)), "A_log": Shard("split", 0, ((h0, h1),)),
                "D": Shard("split", 0, ((h0, h1),)), "norm.weight": Shard("split", 0, (x,)),
                "out_proj.weight": Shard("split", 1, (x,)), "out_proj.bias": RANK0}.get(leaf, REPLICATE)

    @staticmethod
    def _mlp(leaf: str, width: tuple[int, int]) -> Shard:
        return {"up_proj.weight": Shard("split", 0, (width,)), "up_proj.bias": Shard("split", 0, (width,)),
                "down_proj.weight": Shard("split", 1, (width,)), "down_proj.bias": RANK0}.get(leaf, REPLICATE)

    def traffic(self, tokens: int, dtype_bytes: int) -> dict[str, dict[str, int]]:
        """The collectives of one forward of the main stack over `tokens` tokens (logits for all of them),
        from the config alone: {"calls": {kind: n}, "payload": {kind: bytes per rank}} as `Collectives`
        counts them. One all-reduce of [tokens, H] for the embedding and for every layer; one of
        [tokens, n_groups] fp32 per Mamba layer whose groups span ranks; one all-gather of
        [tokens, ceil(V / N)] logits."""
        c = self.config
        layers = len(c.hybrid_override_pattern)
        split_norms = c.hybrid_override_pattern.count(MAMBA) if self.group_span > 1 else 0
        return {"calls": {"all_reduce": 1 + layers + split_norms, "all_gather": 1},
                "payload": {"all_reduce": (1 + layers) * tokens * c.hidden_size * dtype_bytes
                            + split_norms * tokens * c.n_groups * 4,
                            "all_gather": tokens * self.vocab_chunk * dtype_bytes}}

    def layer_kind(self, name: str) -> str | None:
        """The pattern character of the layer tensor `name` belongs to (None for embeddings, head, norm_f)."""
        m = _LAYER.match(name)
        if m is None:
            return None
        pattern = self.config.hybrid_override_pattern if m["stack"] == "backbone" else self.config.mtp_pattern
        return pattern[int(m["i"])]

    def shard_of(self, name: str) -> Shard:
        """`shard(name, layer_kind(name))`."""
        return self.shard(name, self.layer_kind(name))


_LAYER = re.compile(r"^(?P<stack>backbone|mtp)\.layers\.(?P<i>\d+)\.")


def _layers(config: HybridConfig):
    """(module prefix, pattern character) of every layer of the main stack and the MTP block."""
    for i, kind in enumerate(config.hybrid_override_pattern):
        yield f"backbone.layers.{i}.mixer", kind
    if config.num_nextn_predict_layers:
        for i, kind in enumerate(config.mtp_pattern):
            yield f"mtp.layers.{i}.mixer", kind


def _unit(quant: QuantConfig | None, module: str, axis: int) -> int:
    """The step (`QuantFormat.step`) at which packed weight `module` may be cut along its output rows (`axis`
    0) or input columns (1); 1 when it is not packed."""
    fmt = quant.format_for(module) if quant is not None else None
    return 1 if fmt is None else fmt.step(axis)


def width_units(config: HybridConfig, quant: QuantConfig | None) -> dict[str, int]:
    """{"mlp": u, "shared": u}: the blocks each rank's part of the dense MLP / shared-expert width is made of
    (`block_range`), so that no rank's part cuts a scale block of a packed `up_proj` (rows) or `down_proj`
    (columns); 1 where nothing is packed."""
    return {key: math.lcm(1, *(unit for _, unit in units)) for key, units in _width_modules(config, quant).items()}


def _width_modules(config: HybridConfig, quant: QuantConfig | None) -> dict[str, list[tuple[str, int]]]:
    """{"mlp" / "shared": [(module, its step along the width)]} of every up / down projection."""
    out = {"mlp": [], "shared": []}
    for prefix, kind in _layers(config):
        key, mlp = {MLP: ("mlp", prefix), MOE: ("shared", f"{prefix}.shared_experts")}.get(kind, (None, None))
        if key is not None:
            out[key] += [(f"{mlp}.up_proj", _unit(quant, f"{mlp}.up_proj", 0)),
                         (f"{mlp}.down_proj", _unit(quant, f"{mlp}.down_proj", 1))]
    return out


def _packed_problems(config: HybridConfig, N: int, quant: QuantConfig) -> list[str]:
    """What stops packed weights from splitting N ways: a row-parallel weight (`o_proj`, `out_proj`) whose
    input columns per rank are not whole scale blocks, a packed MLP width of fewer blocks than ranks."""
    problems, seen = [], set()
    per_rank = {ATTENTION: ("o_proj", config.num_attention_heads // N * config.head_dim),
                MAMBA: ("out_proj", config.mamba_num_heads // N * config.mamba_head_dim)}
    for prefix, kind in _layers(config):
        if kind in per_rank:
            proj, cols = per_rank[kind]
            unit = _unit(quant, f"{prefix}.{proj}", 1)
            if cols % unit and (proj, unit) not in seen:
                seen.add((proj, unit))
                fmt = quant.format_for(f"{prefix}.{proj}")
                problems.append(f"`{prefix}.{proj}` ({fmt.label}, scale blocks of {unit} input columns) would get "
                                f"{cols} input columns per rank, which cuts a scale block")
    for key, field in (("mlp", "intermediate_size"), ("shared", "moe_shared_expert_intermediate_size")):
        n, modules = getattr(config, field), _width_modules(config, quant)[key]
        unit = math.lcm(1, *(u for _, u in modules))
        if unit > 1 and n and -(-n // unit) < N:
            module = next(m for m, u in modules if u > 1)
            problems.append(f"`{field}` ({n}) is {-(-n // unit)} blocks of {unit} (the scale blocks of "
                            f"`{module}`, {quant.format_for(module).label}), fewer than the ranks: one would "
                            "hold none of it")
    return problems


def _n(r: tuple[int, int]) -> int:
    return r[1] - r[0]
