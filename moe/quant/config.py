"""Checkpoint quantization configs -> a `QuantFormat` (or None) for each module name; and ModelOpt's, written.

Read (module names are the checkpoint's dotted names, e.g. `backbone.layers.3.mixer.experts.5.up_proj`):

- ModelOpt `hf_quant_config.json`: `{"producer": ..., "quantization": {"quant_algo", "kv_cache_quant_algo",
  "group_size", "exclude_modules": [wildcards]}}`; `quant_algo: MIXED_PRECISION` adds a per-module map
  `"quantized_layers": {module: {"quant_algo": ..., "group_size": ...}}` (modules absent from it stay
  unquantized). The same content may sit in config.json as `quantization_config` with
  `"quant_method": "modelopt"` (keys `quant_algo`, `ignore`, `quantized_layers`, `kv_cache_scheme`).
  Algorithms: FP8 (per-tensor + static input scale), FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO (128x128
  blocks), NVFP4, W4A16_NVFP4, MXFP4. Exclusion wildcards are `fnmatch` patterns matched against the
  module and each of its ancestors (reference: vLLM `ModelOptQuantConfigBase.is_layer_excluded`).
- compressed-tensors `quantization_config` (`"quant_method": "compressed-tensors"`): `config_groups`
  `{name: {"targets": [...], "weights": {...}, "input_activations": {...}, "format"?}}`, a top-level
  `format`, `ignore`, `kv_cache_scheme`. Targets and ignores are exact names, `re:` regexes (`re.match`)
  or class names (`Linear`); an exact name beats a regex beats a class. Formats: `float-quantized`
  (FP8, tensor / channel / block strategy), `nvfp4-pack-quantized`, `mxfp4-pack-quantized`.
- `"quant_method": "mxfp4"` (gpt-oss style): every Linear but `modules_to_not_convert`, stored as
  `weight_blocks [out, in/32, 16]` + `weight_scales [out, in/32]`.

Anything else (an unknown method or algorithm, an integer format, a malformed field) is an error that
names the file and the key; nothing is ever guessed.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from fnmatch import translate as fnmatch_translate
from pathlib import Path

from moe.quant.codec import QuantFormat
from moe.quant.formats import COMPRESSED_TENSORS, GPT_OSS_MXFP4, MODELOPT_ALGOS

HF_QUANT_CONFIG = "hf_quant_config.json"

# compressed-tensors `input_activations.dynamic` values under which a format stores a static input scale
# ("local": NVFP4's dynamic block scales under a stored global scale)
CT_STATIC_INPUT = {"float-quantized": (False,), "nvfp4-pack-quantized": (False, "local"), "mxfp4-pack-quantized": ()}


class QuantConfigError(ValueError):
    """A quantization config that cannot be used as it is; the message names the file and key."""


def modelopt_format(algo: str, group_size=None, where: str = "") -> QuantFormat:
    """The `QuantFormat` of a ModelOpt `quant_algo` (case-insensitive; `moe.quant.formats.MODELOPT_ALGOS`)."""
    fmt = MODELOPT_ALGOS.get(str(algo).upper())
    if fmt is None:
        raise QuantConfigError(f"{where}: quant_algo {algo!r} is not supported; expected one of {sorted(MODELOPT_ALGOS)}")
    expected = fmt.codec.group
    if expected and group_size not in (None, expected):
        raise QuantConfigError(f"{where}: {algo} with group_size {group_size}; the format's block size is {expected}")
    return fmt


def _clean_pattern(p) -> str:
    """ModelOpt 0.47 with transformers 5 writes names like 'lm_head.\\x00backbone.pt_name_sentinel' (a leaked
    placeholder of its reverse name mapping); the module name is the part before the NUL, without the dot."""
    p = str(p)
    if "\x00" in p:
        p = p.split("\x00", 1)[0].rstrip(".")
    return p


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass
class QuantConfig:
    """Which format each module has, as a checkpoint declares it.

    method: "modelopt", "compressed-tensors" or "mxfp4".  source: the file it came from (for messages).
    kv_cache: the KV-cache quantization algorithm ("FP8", ...) or None. `k_scale` / `v_scale` tensors are
    kept; the KV cache itself stays in the model dtype.
    files: {file name: JSON content} to write back with the checkpoint (`hf_quant_config.json`, and the
    `quantization_config` block of config.json under the key "config.json").
    """

    method: str
    source: str
    kv_cache: str | None = None
    default: QuantFormat | None = None
    per_module: dict[str, QuantFormat] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    groups: list[tuple[list[str], QuantFormat, str]] = field(default_factory=list)  # compressed-tensors
    files: dict = field(default_factory=dict)

    # ------------------------------------------------------------------------------------ resolving
    def excluded_by(self, name: str) -> str | None:
        """The exclusion pattern that keeps module `name` unquantized, or None."""
        if not self._exclusions().match(name):
            return None
        for pattern in self.exclude:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], name):
                    return pattern
            elif any(fnmatch(a, pattern) for a in _ancestors(name)):
                return pattern
        return None

    def _exclusions(self) -> re.Pattern:
        """One regex that matches a module name some exclusion pattern matches (a `re:` pattern from the start of
        the name, a wildcard the name or one of its ancestors: the name up to a dot), so that the common case, a
        module that is not excluded, takes one match instead of a wildcard per pattern and ancestor (Nemotron 3
        Super's 40 x 512 experts against its exclusions were slow that way: docs/perf-log.md#exclusion-regex).
        Compiled again when `exclude` changes."""
        key = tuple(self.exclude)
        if self.__dict__.get("_exclusions_key") != key:
            parts = [f"(?:{p[3:]})" if p.startswith("re:") else
                     f"(?:{fnmatch_translate(os.path.normcase(p)).removesuffix(chr(92) + 'Z')})(?:\\.|\\Z)"
                     for p in self.exclude]
            self.__dict__["_exclusions_re"] = re.compile("|".join(parts) if parts else "(?!)")
            self.__dict__["_exclusions_key"] = key
        return self.__dict__["_exclusions_re"]

    def format_for(self, name: str, cls: str = "Linear") -> QuantFormat | None:
        """The format of module `name` (a `cls` module: "Linear" for linears and expert projections)."""
        if self.excluded_by(name):
            return None
        if self.method == "compressed-tensors":
            return self._ct_format(name, cls)
        if self.per_module or self.default is None:  # MIXED_PRECISION: only the listed modules
            return self.per_module.get(name)
        return self.default

    def _ct_format(self, name: str, cls: str) -> QuantFormat | None:
        best: dict[int, list[tuple[str, QuantFormat]]] = {}
        for targets, fmt, group in self.groups:
            for t in targets:
                rank = 0 if t == name else 1 if t.startswith("re:") and re.match(t[3:], name) else 2 if t == cls else None
                if rank is not None:
                    best.setdefault(rank, []).append((group, fmt))
        for rank in sorted(best):
            hits = {g: f for g, f in best[rank]}
            if len(hits) > 1:
                raise QuantConfigError(f"{self.source}: module {name!r} matches several config_groups: {sorted(hits)}")
            return next(iter(hits.values()))
        return None

    def labels(self) -> set[str]:
        """The labels of every format the config declares ("NVFP4", "FP8-channel", ...)."""
        fmts = [self.default] + list(self.per_module.values()) + [f for _, f, _ in self.groups]
        return {f.label for f in fmts if f is not None}

    # ------------------------------------------------------------------------------------ reading
    @classmethod
    def from_checkpoint(cls, directory: str | Path, block: dict | None = None) -> "QuantConfig | None":
        """The quantization config of a checkpoint directory (hf_quant_config.json, else config.json's
        `quantization_config` block, passed as `block` by the caller that parsed config.json), or None for an
        unquantized checkpoint."""
        directory = Path(directory)
        path = directory / HF_QUANT_CONFIG
        if path.exists():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except RecursionError:
                raise QuantConfigError(f"{path}: not valid JSON (nested too deeply)") from None
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
                raise QuantConfigError(f"{path}: not valid JSON ({e})") from None
            qc = cls.from_modelopt(raw, str(path))
            if block is not None:
                qc.files["config.json"] = block
            return qc
        if block is None:
            return None
        return cls.from_quantization_config(block, str(directory / "config.json"))

    @classmethod
    def from_quantization_config(cls, block: dict, source: str) -> "QuantConfig":
        """From config.json's `quantization_config` block (any supported `quant_method`)."""
        if not isinstance(block, dict):
            raise QuantConfigError(f"{source}: quantization_config must be an object, got {type(block).__name__}")
        method = str(block.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            qc = cls.from_modelopt(block, f"{source} (quantization_config)")
        elif method == "compressed-tensors":
            qc = cls.from_compressed_tensors(block, f"{source} (quantization_config)")
        elif method == "mxfp4":
            exclude = block.get("modules_to_not_convert") or []
            if not isinstance(exclude, list):
                raise QuantConfigError(f"{source}: quantization_config.modules_to_not_convert must be a list")
            qc = cls("mxfp4", f"{source} (quantization_config)", default=GPT_OSS_MXFP4,
                     exclude=[str(p) for p in exclude])
        else:
            raise QuantConfigError(
                f"{source}: quantization_config.quant_method {block.get('quant_method')!r} is not supported; "
                "expected 'modelopt', 'compressed-tensors' or 'mxfp4'"
            )
        qc.files["config.json"] = block
        return qc

    @classmethod
    def from_modelopt(cls, raw: dict, source: str) -> "QuantConfig":
        """From hf_quant_config.json (`{"quantization": {...}}`) or a config.json `modelopt` block (flat)."""
        nested = "quantization" in raw
        q = raw.get("quantization") if nested else raw
        if not isinstance(q, dict):
            raise QuantConfigError(f"{source}: 'quantization' must be an object")
        algo = q.get("quant_algo")
        if not algo:
            raise QuantConfigError(f"{source}: no quant_algo")
        exclude = q.get("exclude_modules" if nested else "ignore", q.get("exclude_modules", []))
        if exclude is None:
            exclude = []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise QuantConfigError(f"{source}: exclude_modules must be a list of module name patterns (strings), "
                                   f"got {reprlib.repr(exclude)}")
        kv = q.get("kv_cache_quant_algo")
        if not nested and isinstance(q.get("kv_cache_scheme"), dict):
            scheme = q["kv_cache_scheme"]
            kv = "FP8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
        qc = cls("modelopt", source, kv_cache=str(kv).upper() if kv else None,
                 exclude=[_clean_pattern(p) for p in exclude])
        if str(algo).upper() == "MIXED_PRECISION":
            layers = q.get("quantized_layers")
            if not isinstance(layers, dict) or not layers:
                raise QuantConfigError(f"{source}: quant_algo MIXED_PRECISION needs a non-empty 'quantized_layers' map")
            for name, info in layers.items():
                if not isinstance(info, dict) or "quant_algo" not in info:
                    raise QuantConfigError(f"{source}: quantized_layers[{name!r}] has no quant_algo")
                qc.per_module[_clean_pattern(name)] = modelopt_format(
                    info["quant_algo"], info.get("group_size"), f"{source}: quantized_layers[{name!r}]")
        else:
            qc.default = modelopt_format(algo, q.get("group_size"), source)
        if nested:
            qc.files[HF_QUANT_CONFIG] = raw
        return qc

    @classmethod
    def from_compressed_tensors(cls, block: dict, source: str) -> "QuantConfig":
        groups = block.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantConfigError(f"{source}: compressed-tensors config needs a non-empty 'config_groups' object")
        ignore = block.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
            raise QuantConfigError(f"{source}: 'ignore' must be a list of module names or re: patterns (strings), "
                                   f"got {reprlib.repr(ignore)}")
        kv = block.get("kv_cache_scheme")
        kv = "FP8" if isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8 else None
        qc = cls("compressed-tensors", source, kv_cache=kv, exclude=[str(p) for p in ignore])
        for gname, g in groups.items():
            where = f"{source}: config_groups.{gname}"
            if not isinstance(g, dict) or not isinstance(g.get("targets"), list):
                raise QuantConfigError(f"{where} needs a 'targets' list")
            fmt_name = g.get("format") or block.get("format")
            qc.groups.append(([str(t) for t in g["targets"]], _ct_format(fmt_name, g, where), gname))
        return qc


def _ct_format(fmt_name, group: dict, where: str) -> QuantFormat:
    """The `QuantFormat` of one compressed-tensors config group (`moe.quant.formats.COMPRESSED_TENSORS`, its
    layout refined by the group's strategy, block structure and activations)."""
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantConfigError(f"{where}: no 'weights' quantization arguments")
    if not isinstance(fmt_name, str) or fmt_name not in COMPRESSED_TENSORS:
        raise QuantConfigError(f"{where}: compressed-tensors format {fmt_name!r} is not supported; expected one of "
                               f"{list(COMPRESSED_TENSORS)}")
    if w.get("type") != "float" or w.get("symmetric", True) is False:
        raise QuantConfigError(f"{where}: weights must be symmetric floats for {fmt_name}, got {w}")
    base = COMPRESSED_TENSORS[fmt_name]
    codec, layout = base.codec, base.layout
    bits = codec.weight_args(layout)["num_bits"]
    if w.get("num_bits") != bits or (codec.group and w.get("group_size") != codec.group):
        needs = f"num_bits {bits}" + (f" and group_size {codec.group}" if codec.group else "")
        raise QuantConfigError(f"{where}: {fmt_name} needs {needs}, got num_bits {w.get('num_bits')}"
                               + (f" and group_size {w.get('group_size')}" if codec.group else ""))
    if codec.granularities:  # the strategy is the scale granularity
        strategy = str(w.get("strategy") or "").lower()
        if strategy not in codec.granularities:
            raise QuantConfigError(f"{where}: {codec.label(layout)} weight strategy {strategy!r} is not supported "
                                   f"({', '.join(codec.granularities)})")
        block = layout.block
        if strategy == "block":
            bs = w.get("block_structure") or [block, block]
            if not (isinstance(bs, list) and len(bs) == 2 and isinstance(bs[0], int) and not isinstance(bs[0], bool)
                    and bs[0] > 0):
                raise QuantConfigError(f"{where}: block_structure {bs!r} must be [n, n] with n a positive integer")
            if bs[0] != bs[1]:
                raise QuantConfigError(f"{where}: block_structure {bs} is not square")
            block = bs[0]
        layout = replace(layout, granularity=strategy, block=block)
    acts = group.get("input_activations")
    static_input = isinstance(acts, dict) and acts.get("dynamic", True) in CT_STATIC_INPUT[fmt_name]
    return QuantFormat(codec, replace(layout, input_scale=static_input))


def modelopt_config_files(algo: str, exclude: list[str], producer: dict) -> tuple[dict, dict]:
    """(hf_quant_config.json content, config.json `quantization_config` block) for a checkpoint quantized
    with one ModelOpt algorithm (a key of `MODELOPT_ALGOS`), in the layout ModelOpt's `export_hf_checkpoint`
    writes (and vLLM reads)."""
    fmt = MODELOPT_ALGOS[algo]
    weights = fmt.codec.weight_args(fmt.layout)
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if "group_size" in weights:
        quantization["group_size"] = weights["group_size"]
    quantization["exclude_modules"] = list(exclude)
    group = {"weights": weights, "targets": ["Linear"]}
    if fmt.layout.input_scale:
        group["input_activations"] = {k: weights[k] for k in ("dynamic", "num_bits", "type", "group_size") if k in weights}
    block = {"config_groups": {"group_0": group}, "ignore": list(exclude), "quant_algo": algo,
             "producer": producer, "quant_method": "modelopt"}
    return {"producer": producer, "quantization": quantization}, block
