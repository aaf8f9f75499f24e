"""`hybrid.serving.capacity` and `hybrid info --memory`: the sequences a memory budget holds, checked against
caches actually allocated (tiny config) and against the arithmetic from Nemotron 3 Nano's config fields."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid.config import HybridConfig
from hybrid.model import HybridForCausalLM
from hybrid.serving.capacity import parse_bytes, plan
from tiny_checkpoint import TINY

NANO = Path(__file__).resolve().parents[1] / "checkpoints" / "configs" / "nemotron-3-nano-30b-a3b.config.json"


@pytest.mark.parametrize("text, value", [("32GB", 32 * 10**9), ("24GiB", 24 * 2**30), ("512MB", 512 * 10**6),
                                         ("1.5GB", 15 * 10**8), ("1000", 1000), ("2 gib", 2 * 2**30)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "0GB", "32XB", "1e9", "32 GB extra"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="is not a memory size"):
        parse_bytes(text)


def test_concurrency_is_what_allocated_caches_fill(tmp_path):
    """Per-sequence bytes from caches the model really allocates; the concurrency at each length is the
    largest n whose n sequences fit, found by counting."""
    config = HybridConfig(hybrid_override_pattern="M*EM*", **{**TINY, "max_position_embeddings": 4096})
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    block, length = 16, 1000
    cache = model.new_cache(1, capacity=math.ceil(length / block) * block)  # fp32, as the plan below
    seq_bytes = cache.state_nbytes() + cache.blocks.nbytes()  # its slot, and the KV blocks of `length` tokens
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    budget, reserve = weights + 10**6, 10**5
    c = plan(config, torch.float32, budget, max_model_len=length, block_size=block, reserve_bytes=reserve)
    assert c.sequence_bytes(length) == seq_bytes and c.weight_bytes == weights
    n = 0
    while (n + 1) * seq_bytes <= budget - weights - reserve:
        n += 1
    assert c.concurrency[length] == n and c.fits
    assert plan(config, torch.float32, budget, max_model_len=length, block_size=block, reserve_bytes=reserve,
                max_num_seqs=3).concurrency[length] == min(n, 3)
    assert not plan(config, torch.float32, weights + reserve + seq_bytes - 1, max_model_len=length, block_size=block,
                    reserve_bytes=reserve).fits


def test_nano_at_32gb_from_its_config_fields():
    """Nemotron 3 Nano's state and KV from its config fields by hand: 23 Mamba layers of conv (conv_dim x
    (K - 1), bf16) + SSM (heads x head_dim x state, fp32), 6 attention layers of 2 x KV heads x head_dim bf16."""
    raw = json.loads(NANO.read_text())
    config = HybridConfig.from_dict(raw)
    pattern = config.hybrid_override_pattern
    conv_dim = config.mamba_num_heads * config.mamba_head_dim + 2 * config.n_groups * config.ssm_state_size
    state = pattern.count("M") * (conv_dim * (config.conv_kernel - 1) * 2
                                  + config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * 4)
    kv = pattern.count("*") * 2 * config.num_key_value_heads * config.head_dim * 2
    assert (state, kv) == (49_082_368, 6_144)
    from hybrid.quantize import plan as quant_plan

    c = plan(config, torch.bfloat16, 32 * 10**9, quant_plan(config, "nvfp4"))
    free = 32 * 10**9 - c.weight_bytes - 2**30
    for length, n in c.concurrency.items():
        assert n == min(256, free // (state + math.ceil(length / 16) * 16 * kv))
    assert c.fits and c.concurrency[8192] < c.concurrency[1024] == 209
    assert c.bound_at(1024) == "state slots" and c.bound_at(32768) == "KV blocks"
    assert not plan(config, torch.bfloat16, 32 * 10**9).fits  # bf16: 63 GB of weights


def run(*args):
    return subprocess.run([sys.executable, "-m", "hybrid.cli", *args], capture_output=True, text=True, timeout=300)


def test_info_memory_prints_the_plan():
    r = run("info", str(NANO), "--memory", "32GB", "--format", "nvfp4", "--json")
    assert r.returncode == 0, r.stderr
    capacity = json.loads(r.stdout)["capacity"]
    assert capacity["fits"] and capacity["concurrency"]["1024"] == 209
    text = run("info", str(NANO), "--memory", "32GB").stdout
    assert "does not fit: the weights, the reserve and one sequence of 262,144 tokens need 61.38 GiB" in text
    r = run("info", str(NANO), "--memory", "lots")
    assert r.returncode == 2 and "argument --memory: 'lots' is not a memory size" in r.stderr
