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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
_INT_FIELDS = {
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size", "expand",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "n_shared_experts", "n_group", "topk_group", "num_nextn_predict_layers", "max_position_embeddings",
}
_FLOAT_FIELDS = {"layer_norm_epsilon", "routed_scaling_factor", "time_step_min", "time_step_max", "time_step_floor",
                 "initializer_range"}
_BOOL_FIELDS = {"tie_word_embeddings", "attention_bias", "mlp_bias", "use_conv_bias", "use_bias", "norm_topk_prob",
                "rescale_prenorm_residual"}


class ConfigError(ValueError):
    """A config.json that cannot describe a valid model. The message names the field."""


def _decode_json_floats(value: Any) -> Any:
    """Undo transformers 5's JSON encoding of non-finite floats: `{"__float__": "Infinity"}` -> inf."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_json_floats(v) for v in value]
    return value


def block_types_to_pattern(block_types: list[str], field_name: str) -> str:
    """Convert a transformers 5 `layers_block_type` list to a pattern string.

    Raises:
        ConfigError: an entry is not one of `linear_attention`, `full_attention`, `moe`, `mlp` (or the
            legacy `mamba`, `attention`); the message names `field_name` and the entry.
    """
    if not isinstance(block_types, list):
        raise ConfigError(f"`{field_name}` must be a list of block type names, got {type(block_types).__name__}")
    chars = []
    for i, name in enumerate(block_types):
        if name not in _BLOCK_TYPE_TO_CHAR:
            raise ConfigError(
                f"`{field_name}[{i}]` is {name!r}; expected one of {sorted(_BLOCK_TYPE_TO_CHAR)}"
            )
        chars.append(_BLOCK_TYPE_TO_CHAR[name])
    return "".join(chars)


def _check_type(name: str, value: Any) -> None:
    """Raise ConfigError naming `name` when a JSON value has the wrong type (e.g. "32" for 32)."""
    if name in _INT_FIELDS and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f"`{name}` must be an integer, got {value!r}")
    if name == "moe_latent_size" and value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f"`{name}` must be an integer or null, got {value!r}")
    if name in _FLOAT_FIELDS and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ConfigError(f"`{name}` must be a number, got {value!r}")
    if name in _BOOL_FIELDS and not isinstance(value, bool):
        raise ConfigError(f"`{name}` must be true or false, got {value!r}")
    if name == "time_step_limit" and not (
        isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
    ):
        raise ConfigError(f"`time_step_limit` must be [low, high], got {value!r}")


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
            ConfigError: missing layer pattern, unknown pattern character or block type, or an invalid
                size; the message names the field.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        d = _decode_json_floats(dict(raw))
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
        if not isinstance(pattern, str):
            raise ConfigError(f"`hybrid_override_pattern` must be a string, got {type(pattern).__name__}")

        mtp_pattern = cls.mtp_pattern
        if "mtp_hybrid_override_pattern" in d:
            mtp_pattern = d.pop("mtp_hybrid_override_pattern")
            d.pop("mtp_layers_block_type", None)
        elif d.get("mtp_layers_block_type") is not None:
            mtp_pattern = block_types_to_pattern(d.pop("mtp_layers_block_type"), "mtp_layers_block_type")
        d.pop("mtp_layers_block_type", None)

        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d.pop("dtype")
        if "attention_head_dim" in d:  # early Nemotron-H configs
            d.setdefault("head_dim", d.pop("attention_head_dim"))
        kinds = set(pattern) | (set(mtp_pattern) if d.get("num_nextn_predict_layers") else set())
        for kind, names in _REQUIRED.items():
            if kind and kind not in kinds:
                continue
            missing = [n for n in names if n not in d]
            if missing:
                what = f"layers of kind {kind!r}" if kind else "every model"
                raise ConfigError(f"config lacks {', '.join(f'`{n}`' for n in missing)}, required by {what}")
        num_hidden_layers = d.pop("num_hidden_layers", None)

        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "hybrid_override_pattern", "mtp_pattern"}
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        for k, v in kwargs.items():
            _check_type(k, v)
        if kwargs.get("moe_latent_size") == 0:
            kwargs["moe_latent_size"] = None
        if "time_step_limit" in kwargs:
            kwargs["time_step_limit"] = tuple(float(x) for x in kwargs["time_step_limit"])
        config = cls(hybrid_override_pattern=pattern, mtp_pattern=mtp_pattern, extra=d, **kwargs)
        if num_hidden_layers is not None and num_hidden_layers != len(pattern):
            raise ConfigError(
                f"`num_hidden_layers` is {num_hidden_layers} but the layer pattern has {len(pattern)} layers"
            )
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "HybridConfig":
        """Read a config.json. Raises ConfigError naming the file when it is unreadable or invalid."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    # ----------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise ConfigError (naming the field) if the sizes cannot describe a model."""

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        for name, pattern in (("hybrid_override_pattern", self.hybrid_override_pattern), ("mtp_pattern", self.mtp_pattern)):
            for i, ch in enumerate(pattern):
                need(ch in LAYER_CHARS, f"`{name}` has unknown layer character {ch!r} at position {i}; "
                     f"expected one of {''.join(LAYER_CHARS)!r} (M Mamba-2, * attention, E MoE, - MLP)")
        need(len(self.hybrid_override_pattern) > 0, "`hybrid_override_pattern` is empty")
        for name in ("vocab_size", "hidden_size"):
            need(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        need(self.torch_dtype in _DTYPE_NAMES, f"`torch_dtype` is {self.torch_dtype!r}; expected one of {_DTYPE_NAMES}")
        need(self.mlp_hidden_act == "relu2", f"`mlp_hidden_act` is {self.mlp_hidden_act!r}; only 'relu2' is supported")
        kinds = set(self.hybrid_override_pattern) | (set(self.mtp_pattern) if self.num_nextn_predict_layers else set())
        if ATTENTION in kinds:
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                need(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
            need(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                 f"`num_key_value_heads` ({self.num_key_value_heads})")
        if MAMBA in kinds:
            for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"):
                need(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
            need(self.mamba_num_heads % self.n_groups == 0,
                 f"`mamba_num_heads` ({self.mamba_num_heads}) must be a multiple of `n_groups` ({self.n_groups})")
            need(self.mamba_hidden_act == "silu", f"`mamba_hidden_act` is {self.mamba_hidden_act!r}; only 'silu' is supported")
            lo, hi = self.time_step_limit
            need(0.0 <= lo <= hi, f"`time_step_limit` must be (low, high) with 0 <= low <= high, got {self.time_step_limit}")
            need(self.mamba_ssm_cache_dtype in _DTYPE_NAMES,
                 f"`mamba_ssm_cache_dtype` is {self.mamba_ssm_cache_dtype!r}; expected one of {_DTYPE_NAMES}")
        if MLP in kinds:
            need(self.intermediate_size > 0, f"`intermediate_size` must be positive, got {self.intermediate_size}")
        if MOE in kinds:
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
                need(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
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
            need(self.moe_latent_size is None or self.moe_latent_size > 0,
                 f"`moe_latent_size` must be positive or null, got {self.moe_latent_size}")
        need(self.num_nextn_predict_layers >= 0, "`num_nextn_predict_layers` must be >= 0")
        if self.num_nextn_predict_layers:
            need(len(self.mtp_pattern) > 0, "`mtp_hybrid_override_pattern` is empty")

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
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
