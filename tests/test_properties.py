"""Property tests (hypothesis, profile in conftest.py) of the parsers of untrusted bytes and numbers and of the
element codecs (issue 15):

- config.json built from random JSON values either gives a valid `HybridConfig` (which round-trips and builds on
  meta) or raises `ConfigError`, never another exception;
- a config.json `quantization_config` (a valid block with random JSON values) gives a `QuantConfig` or raises
  `QuantConfigError`;
- safetensors headers (random bytes, mutations of a valid header) and index files either load (every tensor
  viewable) or raise `CheckpointError`;
- E4M3, E2M1 and E8M0 decode every code to its table value and encode it back; encoding a random float gives the
  nearest table value, ties to even, saturating (the expected code computed here from the full table in float64).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import tempfile
from pathlib import Path

import torch
from hypothesis import given, strategies as st

from hybrid.checkpoint_files import INDEX_NAME, CheckpointError, CheckpointFiles, SafetensorsFile
from hybrid.config import ConfigError, HybridConfig
from hybrid.loading import build_model
from moe.quant.config import QuantConfig, QuantConfigError
from moe.quant.e2m1 import decode_e2m1, encode_e2m1
from moe.quant.e4m3 import decode_e4m3, e4m3_value, encode_e4m3
from moe.quant.e8m0 import decode_e8m0, encode_e8m0

# ------------------------------------------------------------------------------------------------ JSON values
SCALARS = (st.none() | st.booleans() | st.integers(-3, 70) | st.integers() | st.floats()
           | st.sampled_from(["", "M*E-", "float32", "relu2", "silu", "2", "Infinity"]) | st.text(max_size=6))
JSON = st.recursive(
    SCALARS | st.builds(lambda s: {"__float__": s}, st.sampled_from(["Infinity", "-inf", "nan", "1.5", "x"]) | SCALARS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)

# ------------------------------------------------------------------------------------------------ config.json
BASE = {"hybrid_override_pattern": "M*E-", "vocab_size": 64, "hidden_size": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 4, "ssm_state_size": 4, "n_groups": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "intermediate_size": 8, "moe_shared_expert_intermediate_size": 8, "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E", "eos_token_id": 2, "time_step_limit": [0.0, {"__float__": "Infinity"}]}
KEYS = sorted({f.name for f in dataclasses.fields(HybridConfig)} | {  # and the names only config.json uses
    "num_hidden_layers", "mtp_hybrid_override_pattern", "layers_block_type", "mtp_layers_block_type", "dtype",
    "attention_head_dim", "mamba_n_groups", "mamba_d_conv", "mamba_chunk_size", "mamba_dt_limit", "__float__"})


@given(changes=st.dictionaries(st.sampled_from(KEYS), JSON, max_size=4),
       dropped=st.sets(st.sampled_from(sorted(BASE)), max_size=2),
       extra=st.dictionaries(st.text(max_size=8), JSON, max_size=2))
def test_config_from_random_json_is_valid_or_a_config_error(changes, dropped, extra):
    raw = {k: v for k, v in {**BASE, **extra, **changes}.items() if k not in dropped}
    raw = json.loads(json.dumps(raw))  # as config.json would hold it
    try:
        config = HybridConfig.from_dict(raw)
    except ConfigError:
        return
    config.validate()
    written = json.dumps(config.to_dict(), sort_keys=True)
    assert json.dumps(HybridConfig.from_dict(json.loads(written)).to_dict(), sort_keys=True) == written
    try:
        build_model(config, torch.float32)  # on meta: the sizes hold together
    except ConfigError as e:
        assert "too large for torch" in str(e)


# ------------------------------------------------------------------------------------------------ quantization_config
QUANT_BLOCKS = [
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                        "block_structure": [128, 128], "dynamic": False}}}},
    {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
]


def _paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested JSON object, and one new key in each object."""
    out = [prefix + ("new",)]
    for key, value in node.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _paths(value, prefix + (key,))
    return out


@given(edit=st.sampled_from(QUANT_BLOCKS).flatmap(lambda b: st.tuples(st.just(b), st.sampled_from(_paths(b)))),
       value=JSON | st.sampled_from([["x"], [0, 0], [128], "block", "channel", 4, True]))
def test_quantization_config_from_random_json_is_valid_or_a_quant_config_error(edit, value):
    block, path = json.loads(json.dumps(edit[0])), edit[1]
    node = block
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        QuantConfig.from_checkpoint(Path("/nonexistent"), block)
    except QuantConfigError:
        pass


# ------------------------------------------------------------------------------------------------ safetensors
def _write(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def _loads_or_refuses(path: Path) -> None:
    """SafetensorsFile(path) either raises CheckpointError or serves every tensor as described."""
    try:
        f = SafetensorsFile(path)
    except CheckpointError as e:
        assert str(e).startswith(f"{path}: ")
        return
    for name in f.keys():
        t = f.view(name)
        assert (tuple(t.shape), t.dtype) == (f.shape(name), f.dtype(name))
        f.release(name)


VALID_HEADER = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "U8", "shape": [1, 3], "data_offsets": [8, 11]},
                "c": {"dtype": "BF16", "shape": [0], "data_offsets": [11, 11]}}
ENTRY_VALUES = (JSON | st.sampled_from(["F32", "BF16", "U8", "F8_E4M3", "F7"])
                | st.lists(st.integers(-2, 16), max_size=3) | st.lists(st.integers(), min_size=2, max_size=2))


@given(header=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()), data=st.binary(max_size=16),
       claimed=st.none() | st.integers(0, 2**64 - 1))
def test_random_safetensors_bytes_load_or_raise_checkpoint_error(header, data, claimed):
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d) / "x.safetensors", header, data)
        if claimed is not None:  # a header length that lies
            path.write_bytes(claimed.to_bytes(8, "little") + header + data)
        _loads_or_refuses(path)


@given(edits=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "__metadata__", "new"]),
                                st.sampled_from(["dtype", "shape", "data_offsets", "other", None]),
                                st.none() | ENTRY_VALUES), max_size=3),
       data=st.binary(min_size=0, max_size=16))
def test_mutated_safetensors_header_loads_or_raises_checkpoint_error(edits, data):
    header = json.loads(json.dumps(VALID_HEADER))
    for name, key, value in edits:  # key None: replace the whole entry; value None: delete
        if key is None or not isinstance(header.get(name), dict):
            header[name] = value
        elif value is None:
            header[name].pop(key, None)
        else:
            header[name][key] = value
    with tempfile.TemporaryDirectory() as d:
        _loads_or_refuses(_write(Path(d) / "x.safetensors", json.dumps(header).encode(), data))


SHARDS = ["s1.safetensors", "s2.safetensors", "../s1.safetensors", "sub/s1.safetensors", "/s1.safetensors", "..",
          "", "nope.safetensors", "s1.safetensors\0"]


@given(index=st.one_of(
    st.builds(lambda m: {"weight_map": m},
              st.dictionaries(st.sampled_from(["a", "b", "z"]), st.sampled_from(SHARDS) | JSON, max_size=3)),
    st.builds(lambda m: {"metadata": {}, "weight_map": m}, JSON),
    JSON,
).map(lambda v: json.dumps(v).encode()) | st.binary(max_size=32))
def test_index_files_load_or_raise_checkpoint_error(index):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ckpt"
        (d / "sub").mkdir(parents=True)
        for where, name in ((Path(tmp), "s1"), (d, "s1"), (d / "sub", "s1"), (d, "s2")):
            tensor = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}} if name == "s1" else \
                {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
            _write(where / f"{name}.safetensors", json.dumps(tensor).encode(), bytes(8))
        (d / INDEX_NAME).write_bytes(index)
        try:
            files = CheckpointFiles(d)
        except CheckpointError:
            return
        for name in files.keys():
            assert files.file_of(name).parent == d  # never a file outside the checkpoint directory
            assert files.view(name).shape == files.shape(name)


# ------------------------------------------------------------------------------------------------ codecs
def _e4m3_spec(bits: int) -> float:
    """OFP8 E4M3, from the bit layout alone: S.EEEE.MMM, bias 7, S.1111.111 NaN."""
    s, e, m = bits >> 7, (bits >> 3) & 15, bits & 7
    v = math.nan if (e, m) == (15, 7) else m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


E4M3_TABLE = [_e4m3_spec(b) for b in range(256)]
E2M1_TABLE = [(-1.0 if c & 8 else 1.0) * [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][c & 7] for c in range(16)]


def _nearest_code(x: float, table: list[float]) -> int:
    """The code of the table value nearest to finite x after saturating to the largest value, ties to the even code
    (mantissa bit 0 clear), zero keeping x's sign. float64: x - lo and hi - x are exact for adjacent table values
    lo <= x <= hi (Sterbenz), so the comparison is exact."""
    top = max(v for v in table if not math.isnan(v))
    a = min(abs(x), top)
    grid = sorted({abs(v) for v in table if not math.isnan(v)})
    i = bisect.bisect_left(grid, a)
    if grid[i] == a:
        magnitude = a
    else:
        lo, hi = grid[i - 1], grid[i]
        magnitude = lo if a - lo < hi - a else hi if hi - a < a - lo else None
    sign = math.copysign(1.0, x)
    codes = [c for c, v in enumerate(table) if not math.isnan(v) and math.copysign(1.0, v) == sign]
    if magnitude is None:  # a tie: the code of lo or hi whose mantissa bit is clear
        return next(c for c in codes if abs(table[c]) in (lo, hi) and c % 2 == 0)
    return next(c for c in codes if abs(table[c]) == magnitude)


def _ties_and_neighbours(table: list[float]):
    """Midpoints of adjacent table magnitudes (and one past the largest), exactly or a few float64 ulps or a
    float32-sized step either side: where double rounding through float32 would miss the nearest value."""
    grid = sorted({abs(v) for v in table if not math.isnan(v)})
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])] + [grid[-1] * 1.0625]

    def near(m: float, ulps: int, relative: float, negative: bool) -> float:
        for _ in range(abs(ulps)):
            m = math.nextafter(m, math.copysign(math.inf, ulps))
        m *= 1 + relative
        return -m if negative else m

    return st.builds(near, st.sampled_from(mids), st.integers(-3, 3), st.sampled_from([0.0, 2.0**-25, -(2.0**-25)]),
                     st.booleans())


FLOAT_DTYPES = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])


def _as(xs: list[float], dtype: torch.dtype) -> tuple[torch.Tensor, list[float]]:
    """xs rounded to `dtype` (those that overflow it left out), and the exact values they hold there."""
    t = torch.tensor(xs, dtype=torch.float64).to(dtype)
    t = t[torch.isfinite(t)]
    return t, t.double().tolist()


def test_every_e4m3_code_decodes_to_its_table_value_and_encodes_back():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = decode_e4m3(codes).tolist()
    for b in range(256):
        want = E4M3_TABLE[b]
        assert e4m3_value(b) == want or math.isnan(e4m3_value(b)) and math.isnan(want)
        assert values[b] == want and math.copysign(1, values[b]) == math.copysign(1, want) or \
            math.isnan(values[b]) and math.isnan(want), hex(b)
    for dtype in (torch.float32, torch.float64):  # NaN (0x7F / 0xFF) stays NaN with its sign: every code comes back
        assert encode_e4m3(decode_e4m3(codes).to(dtype)).view(torch.uint8).tolist() == list(range(256))


@given(xs=st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.floats(-500, 500) | st.floats(-0.02, 0.02)
                   | _ties_and_neighbours(E4M3_TABLE), min_size=1, max_size=32), dtype=FLOAT_DTYPES)
def test_e4m3_encodes_to_the_nearest_value_ties_to_even_saturating(xs, dtype):
    t, exact = _as(xs, dtype)
    got = encode_e4m3(t).view(torch.uint8).tolist()
    assert got == [_nearest_code(x, E4M3_TABLE) for x in exact], (dtype, exact)


def test_e4m3_saturates_infinity_and_keeps_nan():
    x = torch.tensor([math.inf, -math.inf, math.nan, 1e300, -1e300], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        got = encode_e4m3(x.to(dtype)).view(torch.uint8).tolist()
        assert got[:2] == [0x7E, 0xFE] and got[2] & 0x7F == 0x7F, dtype
    assert encode_e4m3(x).view(torch.uint8).tolist()[3:] == [0x7E, 0xFE]


def test_every_e2m1_code_decodes_to_its_table_value_and_encodes_back():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes).tolist()
    assert all(v == w and math.copysign(1, v) == math.copysign(1, w) for v, w in zip(values, E2M1_TABLE))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert encode_e2m1(decode_e2m1(codes).to(dtype)).tolist() == list(range(16))
    # no NaN or Inf code: NaN is 6 with its sign, +-Inf saturate
    assert encode_e2m1(torch.tensor([math.nan, -math.nan, math.inf, -math.inf])).tolist() == [7, 15, 7, 15]


@given(xs=st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.floats(-8, 8)
                   | _ties_and_neighbours(E2M1_TABLE), min_size=1, max_size=32), dtype=FLOAT_DTYPES)
def test_e2m1_encodes_to_the_nearest_value_ties_to_even_saturating(xs, dtype):
    t, exact = _as(xs, dtype)
    assert encode_e2m1(t).tolist() == [_nearest_code(x, E2M1_TABLE) for x in exact], (dtype, exact)


def test_every_e8m0_code_decodes_to_its_power_of_two_and_encodes_back():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = decode_e8m0(codes).tolist()
    assert values[:255] == [2.0 ** (c - 127) for c in range(255)] and math.isnan(values[255])
    exponents = torch.tensor([c - 127 for c in range(255)] + [math.nan])
    assert encode_e8m0(exponents).tolist() == list(range(256))


@given(es=st.lists(st.integers(-(2**40), 2**40) | st.integers(-140, 140), min_size=1, max_size=32),
       dtype=st.sampled_from([torch.int64, torch.float64, torch.float32]))
def test_e8m0_encodes_integer_exponents_clamped_to_its_range(es, dtype):
    got = encode_e8m0(torch.tensor(es, dtype=dtype)).tolist()
    want = [min(max(round(float(torch.tensor(e, dtype=dtype))), -127), 127) + 127 for e in es]
    assert got == want
    assert encode_e8m0(torch.tensor([math.inf, -math.inf])).tolist() == [254, 0]


@given(es=st.lists(st.floats(-200, 200), min_size=1, max_size=32))
def test_e8m0_rounds_fractional_exponents_down(es):
    assert encode_e8m0(torch.tensor(es, dtype=torch.float64)).tolist() == \
        [min(max(math.floor(e), -127), 127) + 127 for e in es]
