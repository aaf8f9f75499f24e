"""A new weight format is one codec and one table line: INT8 with one fp32 scale per output channel is defined
in this file alone, registered with one `register` call, and then quantized (`hybrid quantize`), saved,
loaded, run, and reported by `hybrid info --format`, with no change anywhere else.

Oracles: the INT8 definition itself checked element by element in float64 (every dequantized weight is an
integer multiple of its row's scale amax/127, within half a step of the float weight, the row's largest
weight exactly at +-127 steps); the forward of the same model with the dequantized weights as plain float
weights; the packed bytes counted by hand from the config.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import hybrid
from hybrid.cli import main
from moe.experts import QuantExpertBank
from moe.quant import Codec, Layout, PackedWeight, QuantFormat, QuantLinear
from moe.quant import formats
from test_quant_modules import _densify
from tiny_checkpoint import write_checkpoint


class Int8Codec(Codec):
    """Symmetric INT8, one fp32 scale per output row: W = q * scale[row], scale = amax_row / 127."""

    name = "int8"

    def label(self, layout: Layout) -> str:
        return "INT8-channel"

    def specs(self, layout, out_features, in_features):
        return {"data": ((out_features, in_features), torch.int8), "scale": ((out_features,), torch.float32)}

    def quantize(self, w, layout):
        amax = w.detach().float().abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return {"data": torch.round(w.float() / scale[..., None]).clamp(-127, 127).to(torch.int8), "scale": scale}

    def dequantize(self, t, layout):
        return t["data"].float() * t["scale"].float()[..., None]

    def weight_args(self, layout):
        return {"dynamic": False, "num_bits": 8, "type": "int", "strategy": "channel"}


INT8 = QuantFormat(Int8Codec(), Layout())
SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
             head_dim=16, mamba_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)


@pytest.fixture
def int8():
    formats.register("int8", "INT8_PER_CHANNEL", INT8)  # the one line a new format needs
    yield
    formats.unregister("int8")


def _check_int8(dequantized: torch.Tensor, weight: torch.Tensor, where: str) -> None:
    """float64: each row is k * amax_row / 127 with integer |k| <= 127, within half a step of the weight."""
    w, d = weight.double(), dequantized.double()
    step = w.abs().amax(dim=-1, keepdim=True) / 127
    k = d / step
    assert torch.allclose(k, k.round(), atol=1e-4), where
    assert float(k.abs().max()) <= 127 + 1e-4, where
    assert bool(((d - w).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()), where
    assert torch.allclose(k.abs().amax(dim=-1), torch.full_like(k[..., 0], 127.0), atol=1e-4), where


def test_a_new_format_is_one_codec_and_one_table_line(int8, tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", pattern="ME*E", seed=5, **SIZES)
    dst = tmp_path / "int8"
    assert main(["quantize", str(src), str(dst), "--format", "int8"]) == 0
    capsys.readouterr()
    assert json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "INT8_PER_CHANNEL"

    model = hybrid.load_model(dst, dtype="fp32")
    float_model = hybrid.load_model(src, dtype="fp32")
    assert model.quantization.labels() == {"INT8-channel"}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, PackedWeight)}
    # default exclusions for ME*E: layer 0's Mamba projections feed attention; so the MoE layers' experts
    # (both projections) and shared experts are INT8
    assert sorted(quantized) == sorted(f"backbone.layers.{i}.mixer.{p}" for i in (1, 3) for p in (
        "experts.up_proj", "experts.down_proj", "shared_experts.up_proj", "shared_experts.down_proj"))
    float_tensors = float_model.state_dict()
    for name, module in quantized.items():
        weight = float_tensors[f"{name}.weight" if isinstance(module, QuantLinear) else name]
        _check_int8(module.dequantize(), weight, name)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    name = "backbone.layers.1.mixer.experts.3.up_proj"
    with safe_open(dst / shard[f"{name}.weight"], "pt") as f:
        assert f.get_slice(f"{name}.weight").get_dtype() == "I8"
    with safe_open(dst / shard[f"{name}.weight_scale"], "pt") as f:
        assert f.get_slice(f"{name}.weight_scale").get_shape() == [32]

    ids = torch.randint(5, 300, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(ids)
        want = _densify(hybrid.load_model(dst, dtype="fp32"))(ids)
    assert isinstance(model.backbone.layers[1].mixer.experts, QuantExpertBank)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)

    assert main(["info", str(src), "--format", "int8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    H, E, I, S = 64, 8, 32, 48
    int8_bytes = lambda o, i, n=1: n * (o * i + 4 * o)  # noqa: E731  int8 codes + an fp32 scale per row
    per_layer = int8_bytes(I, H, E) + int8_bytes(H, I, E) + int8_bytes(S, H) + int8_bytes(H, S)
    assert info["bytes_by_format"]["INT8-channel"] == 2 * per_layer
    assert info["quantization"]["formats"] == ["INT8-channel"]
    stored = sum(m.nbytes() for m in quantized.values())
    assert stored == 2 * per_layer


def test_unregistered_format_is_refused(tmp_path):
    """Without the registration, the same checkpoint names an unknown quant_algo and the CLI an unknown format."""
    with pytest.raises(SystemExit):
        main(["info", "--format", "int8"])
    assert "int8" not in formats.QUANTIZE_FORMATS and "INT8_PER_CHANNEL" not in formats.MODELOPT_ALGOS
