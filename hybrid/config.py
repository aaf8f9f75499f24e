"""The model configuration: one dataclass that reads both published `config.json` dialects.

Dialects:
- NVIDIA releases: `hybrid_override_pattern` (a string of `M` Mamba-2, `*` attention, `E` MoE, `-` dense
  MLP), legacy names `mamba_n_groups`, `mamba_d_conv`, `mamba_chunk_size`, `mamba_dt_limit`, ...
- transformers 5 `save_pretrained`: `layers_block_type` (a list of `linear_attention`, `full_attention`,
  `moe`, `mlp`; older lists say `mamba`, `attention`) and JSON-encoded floats such as
  `{"__float__": "Infinity"}`.

Field names are those of transformers' `NemotronHConfig`. The layer pattern is kept as a pattern string.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybrid.dtypes import DTYPES

MAMBA, ATTENTION, MOE, MLP = "M", "*", "E", "-"
LAYER_CHARS = (MAMBA, ATTENTION, MOE, MLP)

# transformers 5 block type names (and their legacy spellings) -> pattern characters.
_BLOCK_TYPE_TO_CHAR = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "moe": MOE,
    "mlp": MLP,
}

# NVIDIA's legacy names -> transformers names.
_LEGACY_NAMES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}

_DTYPE_NAMES = tuple(DTYPES)

# Fields that fix tensor shapes: a config.json that uses a layer kind must state them (no silent defaults).
_REQUIRED = {
    "": ("vocab_size", "hidden_size"),
    MAMBA: ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups"),
    ATTENTION: ("num_attention_heads", "num_key_value_heads", "head_dim"),
    MOE: ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    MLP: ("intermediate_size",),
}
class ConfigError(ValueError):
    """A config.json that cannot describe a valid model. The message names the field."""


# Bounds on what a config may describe, checked arithmetically before anything is built (`check_sizes`). The
# largest published models have < 10^13 parameters, < 1000 layers and < 2^16 experts per MoE layer; these
# limits are generous, and keep a hostile config from exhausting memory or time while the model is built.
MAX_LAYERS = 4096  # per layer pattern (main stack, MTP block)
MAX_EXPERTS = 2**16  # `n_routed_experts`
MAX_PARAMETERS = 10**14  # in all; also keeps every tensor's byte count far inside torch's int64


# ----------------------------------------------------------------------------------------- field kinds
# Every field is checked against one kind, declared once in `_KINDS`: what JSON value it must hold (in
# words, for the message) and a test of the parsed value. bool is an int subclass in Python: `true` is no size.
_LIMIT = 2**31  # sizes and token ids fit int32; torch multiplies sizes into int64 shapes and byte counts


@dataclass(frozen=True)
class _Kind:
    expected: str
    ok: Callable[[Any], bool]


def _int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < _LIMIT


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _one_of(*names: str, why: str = "") -> _Kind:
    return _Kind(", ".join(map(repr, names)) + why if len(names) == 1 else
                 f"one of {', '.join(map(repr, names))}", lambda v: isinstance(v, str) and v in names)


SIZE = _Kind("a positive integer below 2^31", lambda v: _int(v, 1))
COUNT = _Kind("an integer in [0, 2^31)", _int)
FLAG = _Kind("true or false", lambda v: isinstance(v, bool))
NON_NEGATIVE = _Kind("a finite number >= 0", lambda v: _number(v) and 0 <= v < math.inf)
POSITIVE = _Kind("a finite number > 0", lambda v: _number(v) and 0 < v < math.inf)
TOKEN_ID = _Kind("a token id (an integer in [0, 2^31)) or null", lambda v: v is None or _int(v))
TOKEN_IDS = _Kind("a token id (an integer in [0, 2^31)), a list of them, or null",
                  lambda v: v is None or _int(v) or (isinstance(v, list) and all(map(_int, v))))
PATTERN = _Kind("a string of layer characters (M Mamba-2, * attention, E MoE, - MLP)", lambda v: isinstance(v, str))
DTYPE = _one_of(*_DTYPE_NAMES)

_KINDS: dict[str, _Kind] = {
    "hybrid_override_pattern": PATTERN, "mtp_pattern": PATTERN, "mtp_hybrid_override_pattern": PATTERN,
    **dict.fromkeys(("num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                     "n_groups", "conv_kernel", "chunk_size", "expand", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "n_group", "topk_group", "max_position_embeddings"), SIZE),
    **dict.fromkeys(("moe_shared_expert_intermediate_size", "n_shared_experts"), COUNT),
    "num_nextn_predict_layers": _Kind("0 or 1 (one MTP module at most is supported)", lambda v: _int(v) and v <= 1),
    "moe_latent_size": _Kind("a positive integer below 2^31, or 0 or null for none", lambda v: v is None or _int(v)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_conv_bias", "use_bias",
                     "norm_topk_prob", "rescale_prenorm_residual"), FLAG),
    **dict.fromkeys(("layer_norm_epsilon", "time_step_min", "time_step_max", "time_step_floor",
                     "initializer_range"), NON_NEGATIVE),
    "routed_scaling_factor": POSITIVE,
    "time_step_limit": _Kind("[low, high] with 0 <= low <= high", lambda v: isinstance(v, (list, tuple))
                             and len(v) == 2 and all(map(_number, v)) and 0 <= v[0] <= v[1]),
    "torch_dtype": DTYPE, "mamba_ssm_cache_dtype": DTYPE,
    "mlp_hidden_act": _one_of("relu2", why=" (the only activation supported)"),
    "mamba_hidden_act": _one_of("silu", why=" (the only activation supported)"),
    "bos_token_id": TOKEN_ID, "pad_token_id": TOKEN_ID, "eos_token_id": TOKEN_IDS,
    "quantization_config": _Kind("an object or null", lambda v: v is None or isinstance(v, dict)),
}


_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 100


def _shown(value: Any) -> str:
    """repr() of a JSON value, shortened (and safe for any nesting depth) for messages."""
    return _REPR.repr(value)


def check_field(name: str, value: Any) -> None:
    """Check one field's value against its declared kind.

    Raises:
        ConfigError: `value` is not what `name` must hold; the message names the field, the value and the
            expected JSON type (e.g. "`eos_token_id` must be a token id ..., got '2'").
    """
    kind = _KINDS[name]
    if not kind.ok(value):
        raise ConfigError(f"`{name}` must be {kind.expected}, got {_shown(value)}")


def _decode_json_floats(value: Any, where: str) -> Any:
    """Undo transformers 5's JSON encoding of non-finite floats: `{"__float__": "Infinity"}` -> inf.

    Raises:
        ConfigError: a `{"__float__": ...}` that does not spell a float; the message names `where`.
    """
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            text = value["__float__"]
            try:
                if isinstance(text, str):
                    return float(text)
            except ValueError:
                pass
            raise ConfigError(f"`{where}` is {_shown(value)}; expected a float spelled as a string, e.g. "
                              '{"__float__": "Infinity"}')
        return {k: _decode_json_floats(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_json_floats(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def block_types_to_pattern(block_types: list[str], field_name: str) -> str:
    """Convert a transformers 5 `layers_block_type` list to a pattern string.

    Raises:
        ConfigError: an entry is not one of `linear_attention`, `full_attention`, `moe`, `mlp` (or the
            legacy `mamba`, `attention`); the message names `field_name` and the entry.
    """
    if not isinstance(block_types, list):
        raise ConfigError(f"`{field_name}` must be a list of block type names, got {_shown(block_types)}")
    chars = []
    for i, name in enumerate(block_types):
        if not isinstance(name, str) or name not in _BLOCK_TYPE_TO_CHAR:
            raise ConfigError(
                f"`{field_name}[{i}]` is {_shown(name)}; expected one of {sorted(_BLOCK_TYPE_TO_CHAR)}"
            )
        chars.append(_BLOCK_TYPE_TO_CHAR[name])
    return "".join(chars)


@dataclass
class HybridConfig:
    """Hyper-parameters of a Nemotron-H style hybrid model (names as in transformers' `NemotronHConfig`).

    `hybrid_override_pattern` has one character per layer: `M` Mamba-2 mixer, `*` GQA attention (no
    positional encoding), `E` routed MoE with a shared expert, `-` dense squared-ReLU MLP. `mtp_pattern`
    describes the multi-token-prediction block (used only when `num_nextn_predict_layers > 0`).
    """

    hybrid_override_pattern: str = "M*E-"
    vocab_size: int = 131072
    hidden_size: int = 4096
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    # attention ('*')
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    # dense MLP ('-') and the activation of every MLP
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba-2 ('M')
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    expand: int = 2  # a leftover in published configs: d_inner is mamba_num_heads * mamba_head_dim
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001  # initialisation only: never a clamp (tests/test_cases.py, case 1)
    time_step_max: float = 0.1  # initialisation only
    time_step_floor: float = 1e-4  # initialisation only
    mamba_ssm_cache_dtype: str = "float32"
    # MoE ('E')
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_shared_experts: int = 1
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # multi-token prediction
    num_nextn_predict_layers: int = 0
    mtp_pattern: str = "*E"
    # tokens and bookkeeping
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 0
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    quantization_config: dict | None = None
    extra: dict = field(default_factory=dict, repr=False)  # keys we do not interpret, kept for writing back

    # ----------------------------------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, raw: dict) -> "HybridConfig":
        """Build from a parsed config.json of either dialect.

        Raises:
            ConfigError: not a JSON object; missing layer pattern or required size; unknown pattern character
                or block type; a field of the wrong type or range (`check_field`, e.g. `eos_token_id: "2"`);
                a malformed `{"__float__": ...}`; sizes that do not fit together (`validate`). The message
                names the field and the value.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        try:
            d = {k: _decode_json_floats(v, k) for k, v in raw.items()}
        except RecursionError:
            raise ConfigError("config nests lists or objects too deeply") from None
        for old, new in _LEGACY_NAMES.items():
            if old in d:
                value = d.pop(old)
                d.setdefault(new, value)

        if "hybrid_override_pattern" in d:
            pattern = d.pop("hybrid_override_pattern")
            d.pop("layers_block_type", None)
        elif "layers_block_type" in d:
            pattern = block_types_to_pattern(d.pop("layers_block_type"), "layers_block_type")
        else:
            raise ConfigError("config has neither `hybrid_override_pattern` nor `layers_block_type`")
        check_field("hybrid_override_pattern", pattern)

        mtp_pattern = cls.mtp_pattern
        if "mtp_hybrid_override_pattern" in d:
            mtp_pattern = d.pop("mtp_hybrid_override_pattern")
            check_field("mtp_hybrid_override_pattern", mtp_pattern)
        elif d.get("mtp_layers_block_type") is not None:
            mtp_pattern = block_types_to_pattern(d.pop("mtp_layers_block_type"), "mtp_layers_block_type")
        d.pop("mtp_layers_block_type", None)

        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d.pop("dtype")
        if "attention_head_dim" in d:  # early Nemotron-H configs
            d.setdefault("head_dim", d.pop("attention_head_dim"))
        num_hidden_layers = d.pop("num_hidden_layers", None)
        if num_hidden_layers is not None:
            check_field("num_hidden_layers", num_hidden_layers)
            if num_hidden_layers != len(pattern):
                raise ConfigError(
                    f"`num_hidden_layers` is {num_hidden_layers} but the layer pattern has {len(pattern)} layers"
                )

        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "hybrid_override_pattern", "mtp_pattern"}
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        for k, v in kwargs.items():
            check_field(k, v)
        kinds = set(pattern) | (set(mtp_pattern) if kwargs.get("num_nextn_predict_layers") else set())
        for kind, names in _REQUIRED.items():
            if kind and kind not in kinds:
                continue
            missing = [n for n in names if n not in kwargs]
            if missing:
                what = f"layers of kind {kind!r}" if kind else "every model"
                raise ConfigError(f"config lacks {', '.join(f'`{n}`' for n in missing)}, required by {what}")
        if kwargs.get("moe_latent_size") == 0:
            kwargs["moe_latent_size"] = None
        if "time_step_limit" in kwargs:
            kwargs["time_step_limit"] = tuple(float(x) for x in kwargs["time_step_limit"])
        config = cls(hybrid_override_pattern=pattern, mtp_pattern=mtp_pattern, extra=d, **kwargs)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "HybridConfig":
        """Read a config.json (UTF-8 JSON) and build it with `from_dict`.

        Raises:
            ConfigError: the file is missing or unreadable, is not JSON, or `from_dict` refuses it; the message
                starts with the file's path.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except OSError as e:  # a directory, no permission, ...
            raise ConfigError(f"{path}: cannot read ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    # ----------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Check every field against its kind (`check_field`), then the relations between fields.

        Raises:
            ConfigError: a field of the wrong type or range, an unknown layer character, sizes that do not
                fit together (heads not a multiple of groups, more experts per token than experts, ...), or
                sizes beyond the bounds of `check_sizes` (layers, experts, parameters); the message names the
                field(s).
        """

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        for f in dataclasses.fields(self):
            if f.name != "extra":
                check_field(f.name, getattr(self, f.name))
        self.check_sizes()
        for name, pattern in (("hybrid_override_pattern", self.hybrid_override_pattern), ("mtp_pattern", self.mtp_pattern)):
            for i, ch in enumerate(pattern):
                need(ch in LAYER_CHARS, f"`{name}` has unknown layer character {ch!r} at position {i}; "
                     f"expected one of {''.join(LAYER_CHARS)!r} (M Mamba-2, * attention, E MoE, - MLP)")
        need(len(self.hybrid_override_pattern) > 0, "`hybrid_override_pattern` is empty")
        kinds = set(self.hybrid_override_pattern) | (set(self.mtp_pattern) if self.num_nextn_predict_layers else set())
        if ATTENTION in kinds:
            need(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                 f"`num_key_value_heads` ({self.num_key_value_heads})")
        if MAMBA in kinds:
            need(self.mamba_num_heads % self.n_groups == 0,
                 f"`mamba_num_heads` ({self.mamba_num_heads}) must be a multiple of `n_groups` ({self.n_groups})")
        if MOE in kinds:
            need(self.num_experts_per_tok <= self.n_routed_experts,
                 f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds `n_routed_experts` ({self.n_routed_experts})")
            need(self.n_routed_experts % self.n_group == 0,
                 f"`n_routed_experts` ({self.n_routed_experts}) must be a multiple of `n_group` ({self.n_group})")
            need(self.topk_group <= self.n_group, f"`topk_group` ({self.topk_group}) exceeds `n_group` ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            need(self.n_group == 1 or per_group >= 2,
                 f"grouped routing scores each group by its top-2 experts: `n_routed_experts / n_group` is {per_group}")
            need(self.num_experts_per_tok <= self.topk_group * per_group,
                 f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds the experts in `topk_group` groups "
                 f"({self.topk_group * per_group})")
            need(self.n_shared_experts in (0, 1), f"`n_shared_experts` must be 0 or 1, got {self.n_shared_experts}")
            if self.n_shared_experts:
                need(self.moe_shared_expert_intermediate_size > 0, "`moe_shared_expert_intermediate_size` must be positive")
        if self.num_nextn_predict_layers:
            need(len(self.mtp_pattern) > 0, "`mtp_hybrid_override_pattern` is empty")

    def parameter_terms(self) -> list[tuple[str, int]]:
        """The parameters the config describes, by part: [(fields that multiply to it, count), ...], computed
        from the fields alone, nothing built (the weight matrices exactly, a few small vectors approximately)."""
        def named(*names: str) -> str:
            return " * ".join(f"`{n}` ({getattr(self, n)})" for n in names)

        H, V = self.hidden_size, self.vocab_size
        d_inner, conv_dim, nh = self.d_inner, self.conv_dim, self.mamba_num_heads
        latent = self.moe_latent_size or H
        expert_in = "moe_latent_size" if self.moe_latent_size else "hidden_size"
        heads = max(("num_attention_heads", "num_key_value_heads"), key=lambda n: getattr(self, n))
        per_kind = {
            MAMBA: (named("mamba_num_heads", "mamba_head_dim", "hidden_size") + " (Mamba-2 layers)",
                    H * (d_inner + conv_dim + nh) + conv_dim * self.conv_kernel + 3 * nh + d_inner + d_inner * H + H),
            ATTENTION: (named(heads, "head_dim", "hidden_size") + " (attention layers)",
                        2 * H * self.num_attention_heads * self.head_dim + 2 * H * self.num_key_value_heads * self.head_dim + H),
            MOE: (named("n_routed_experts", "moe_intermediate_size", expert_in) + " (MoE layers)",
                  2 * self.n_routed_experts * self.moe_intermediate_size * latent + self.n_routed_experts * (H + 1)
                  + 2 * H * self.moe_shared_expert_intermediate_size * self.n_shared_experts
                  + (2 * H * latent if self.moe_latent_size else 0) + H),
            MLP: (named("intermediate_size", "hidden_size") + " (MLP layers)", 2 * H * self.intermediate_size + H),
        }
        terms = [(named("vocab_size", "hidden_size") + " (embedding and LM head)", V * H * (1 if self.tie_word_embeddings else 2) + H)]
        patterns = [self.hybrid_override_pattern] + ([self.mtp_pattern] if self.num_nextn_predict_layers else [])
        for pattern in patterns:
            for kind, (fields, count) in per_kind.items():
                n = pattern.count(kind)
                if n:
                    terms.append((fields, n * count))
        if self.num_nextn_predict_layers:
            terms.append((named("hidden_size") + " (MTP projection)", 2 * H * H + 3 * H))
        return terms

    def check_sizes(self) -> None:
        """Bound what the config describes, arithmetically, before anything is built: at most `MAX_LAYERS`
        layers per pattern, `MAX_EXPERTS` routed experts and `MAX_PARAMETERS` parameters in all.

        Raises:
            ConfigError: a pattern of more than `MAX_LAYERS` layers, more than `MAX_EXPERTS` experts, or more
                than `MAX_PARAMETERS` parameters; the message names the field(s), the value and the limit.
        """
        for name, pattern in (("hybrid_override_pattern", self.hybrid_override_pattern), ("mtp_pattern", self.mtp_pattern)):
            if isinstance(pattern, str) and len(pattern) > MAX_LAYERS:
                raise ConfigError(f"`{name}` describes {len(pattern):,} layers; at most {MAX_LAYERS:,} are supported")
        kinds = set(self.hybrid_override_pattern) | (set(self.mtp_pattern) if self.num_nextn_predict_layers else set())
        if MOE in kinds and self.n_routed_experts > MAX_EXPERTS:
            raise ConfigError(f"`n_routed_experts` is {self.n_routed_experts:,}; at most {MAX_EXPERTS:,} "
                              "experts per MoE layer are supported")
        terms = self.parameter_terms()
        total = sum(n for _, n in terms)
        if total > MAX_PARAMETERS:
            fields, largest = max(terms, key=lambda t: t[1])
            raise ConfigError(f"the sizes describe {total:.3g} parameters, more than the limit of {MAX_PARAMETERS:.0e}; "
                              f"the largest part is {fields}: {largest:.3g} parameters")

    # ----------------------------------------------------------------------------------------- derived
    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def d_inner(self) -> int:
        """Mamba-2 inner width: mamba_num_heads * mamba_head_dim (not expand * hidden_size)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Mamba-2 causal conv: x, B and C = d_inner + 2 * n_groups * ssm_state_size."""
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    def layer_indices(self, kind: str) -> list[int]:
        """Indices of the layers of one kind (`M`, `*`, `E` or `-`) in the main stack."""
        return [i for i, ch in enumerate(self.hybrid_override_pattern) if ch == kind]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # ----------------------------------------------------------------------------------------- writing
    def to_dict(self) -> dict:
        """The NVIDIA dialect (`hybrid_override_pattern`), which transformers' NemotronHConfig also reads."""
        d = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "mtp_pattern"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            if f.name == "quantization_config" and value is None:
                continue
            d[f.name] = value
        if self.time_step_limit == (0.0, math.inf):  # the default; NVIDIA's configs leave it out
            del d["time_step_limit"]
        else:  # transformers 5's JSON encoding of a non-finite float
            d["time_step_limit"] = [v if math.isfinite(v) else {"__float__": "Infinity"} for v in self.time_step_limit]
        if self.num_nextn_predict_layers:
            d["mtp_hybrid_override_pattern"] = self.mtp_pattern
        d["num_hidden_layers"] = self.num_hidden_layers
        d.setdefault("model_type", "nemotron_h")
        d.setdefault("architectures", ["NemotronHForCausalLM"])
        return d

    def save(self, path: str | Path) -> None:
        from hybrid.atomic import atomic_write_text  # a failed write leaves the previous file

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
