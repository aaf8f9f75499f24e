"""The inference cache (the engine's paged cache; `model.new_cache` gives its step-by-step form, `BatchCache`):
every way of feeding tokens through it equals one full forward.

Oracles: our own model run in one pass without a cache (itself checked against transformers in
test_parity.py), each of several packed sequences of different lengths run alone, and hand-computed byte counts.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid.config import HybridConfig
from hybrid.serving.paged_cache import BatchCache
from helpers import InterfaceOnly, Packed, random_ids

CACHE_CONFIGS = ["all4_ng2_gqa4_c8", "ngnh_mqa_c8_k2", "chunk64_ng2", "nano_like_c16"]
# fp32 rounding only: different chunkings / batchings sum in other orders. Logits are O(1..5) here and
# pass through up to 7 layers, so differences are ~1e-6..2e-5; a real fault is >= 1e-2.
TOL = 5e-5


def feed(model, ids: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, BatchCache]:
    """Feed ids [B, T] through one cache in segments of `sizes`; the logits of every position."""
    cache = model.new_cache(ids.shape[0])
    outs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            outs.append(model(ids[:, start : start + n], cache=cache))
            start += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_prefill_then_decode_equals_full_forward(checkpoint, config):
    ck = checkpoint(config)
    T = 2 * ck.chunk_size + 7
    ids = random_ids(T, ck.vocab_size, seed=61, batch=2)
    with torch.no_grad():
        full = ck.ours(ids)
    for prefill in (1, 3, ck.chunk_size, ck.chunk_size + 1):
        logits, cache = feed(ck.ours, ids, [prefill] + [1] * (T - prefill))
        assert cache.seq_len == T
        diff = (logits - full).abs().max()
        assert diff <= TOL, f"prefill {prefill}: every-position max diff {diff:.3g}"


@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_any_split_equals_one_pass(checkpoint, config):
    ck = checkpoint(config)
    T = 3 * ck.chunk_size + 5
    ids = random_ids(T, ck.vocab_size, seed=62, batch=2)
    with torch.no_grad():
        full = ck.ours(ids)
    for seed in range(4):
        rng = random.Random(seed)
        sizes = []
        while sum(sizes) < T:
            sizes.append(min(rng.randint(1, ck.chunk_size + 3), T - sum(sizes)))
        logits, _ = feed(ck.ours, ids, sizes)
        diff = (logits - full).abs().max()
        assert diff <= TOL, f"split {sizes}: max diff {diff:.3g}"


@pytest.mark.parametrize("config", ["grouped_routing_c16", "ngnh_mqa_c8_k2"])
def test_packed_sequences_of_different_lengths_equal_each_alone(checkpoint, config):
    """Prompts of different lengths in one packed forward, then a 5-token segment each, then single-token
    decode steps: each sequence's logits equal its run alone at every position (no padding anywhere)."""
    ck = checkpoint(config)
    lengths = [1, 5, ck.chunk_size + 2, 2 * ck.chunk_size + 1]
    prompts = [random_ids(n, ck.vocab_size, seed=70 + n)[0] for n in lengths]
    tail = random_ids(7, ck.vocab_size, seed=71, batch=len(prompts))  # 5-token segment + 2 single steps
    packed = Packed(ck.ours, len(prompts))
    steps = [packed.step([p.tolist() for p in prompts])]
    for s0, s1 in ((0, 5), (5, 6), (6, 7)):
        steps.append(packed.step([t[s0:s1].tolist() for t in tail]))
    for i, p in enumerate(prompts):
        alone, _ = feed(ck.ours, torch.cat([p[None], tail[i : i + 1]], 1), [len(p), 5, 1, 1])
        diff = (torch.cat([step[i] for step in steps]) - alone[0]).abs().max()
        assert diff <= TOL, f"sequence {i} (length {len(p)}): max diff {diff:.3g}"


@pytest.mark.parametrize("config", ["ngnh_mqa_c8_k2", "chunk64_ng2", "nano_like_c16"])
def test_a_packed_prefill_leaves_each_sequence_its_own_state(checkpoint, config):
    """After one packed prefill of prompts of different lengths, each sequence's Mamba state (conv window, SSM
    state, in its slot) and its keys and values (in its blocks) equal those of the prompt alone."""
    ck = checkpoint(config)
    K1 = ck.ours.config.conv_kernel - 1
    prompts = [random_ids(n, ck.vocab_size, seed=80 + n)[0] for n in (1, K1, ck.chunk_size - 1, ck.chunk_size + 4)]
    packed = Packed(ck.ours, len(prompts))
    packed.step([p.tolist() for p in prompts])
    for i, p in enumerate(prompts):
        alone = ck.ours.new_cache(1)
        with torch.no_grad():
            ck.ours(p[None], cache=alone)
        slot = packed.rows[i][1]
        for conv, ssm, ref_conv, ref_ssm in zip(packed.slots.conv, packed.slots.ssm, alone.slots.conv, alone.slots.ssm):
            assert torch.allclose(conv[slot], ref_conv[0], atol=TOL) and torch.allclose(ssm[slot], ref_ssm[0], atol=TOL)
        packed.cache.schedule(packed.cache.seqs)  # read sequence i's rows
        for (k, v), (ref_k, ref_v) in zip(packed.cache.snapshot_kv(i, 0, len(p)), alone.snapshot_kv(0, 0, len(p))):
            assert torch.allclose(k, ref_k, atol=TOL) and torch.allclose(v, ref_v, atol=TOL)


def test_a_cache_takes_no_padding_but_transformers_full_masks(checkpoint):
    """transformers passes attention_mask as [B, past + T] of ones: the same as none. Padding on a cache is
    refused, naming what runs prompts of different lengths; so is another batch size."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    ids = random_ids(9, ck.vocab_size, seed=4, batch=2)
    step = random_ids(1, ck.vocab_size, seed=3, batch=2)
    a, b = ck.ours.new_cache(2), ck.ours.new_cache(2)
    with torch.no_grad():
        ck.ours(ids, cache=a)
        ck.ours(ids, cache=b, attention_mask=torch.ones(2, 9, dtype=torch.long))
        la = ck.ours(step, cache=a)
        lb = ck.ours(step, cache=b, attention_mask=torch.ones(2, 10, dtype=torch.long))
        assert torch.equal(la, lb)
        with pytest.raises(ValueError, match="takes no padding.*Engine"):
            ck.ours(step, cache=a, attention_mask=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="batch size"):
        ck.ours(step, cache=ck.ours.new_cache(3))


# --------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cache_bytes_hand_computed(checkpoint, dtype):
    """all4_ng2_gqa4_c8: one Mamba layer (nh 4, P 8, N 8, ng 2, K 4: conv_dim = 32 + 2*2*8 = 64) and one
    attention layer (2 KV heads of 8). Batch 2, 10 tokens, then 5 more:
      KV    = 1 layer * 2 (K, V) * 2 seqs * 2 heads * T * 8 * bytes      = 64 * T * bytes
      state = 2 seqs * (64 * 3 conv * bytes + 4*8*8 * 4 bytes fp32 SSM)  = 384 * bytes + 2048
    """
    import hybrid

    ck = checkpoint("all4_ng2_gqa4_c8")
    model = ck.ours if dtype == "fp32" else hybrid.load_model(ck.directory, dtype="bf16")
    nbytes = 4 if dtype == "fp32" else 2
    cache = model.new_cache(2, capacity=64)  # preallocated room is not counted
    assert cache.kv_nbytes() == 0
    with torch.no_grad():
        model(random_ids(10, ck.vocab_size, seed=1, batch=2), cache=cache)
        assert cache.kv_nbytes() == 64 * 10 * nbytes
        assert cache.state_nbytes() == 384 * nbytes + 2048
        for t in range(5):
            model(random_ids(1, ck.vocab_size, seed=t, batch=2), cache=cache)
    assert cache.kv_nbytes() == 64 * 15 * nbytes
    assert cache.state_nbytes() == 384 * nbytes + 2048
    assert cache.nbytes() == cache.kv_nbytes() + cache.state_nbytes()


def test_cache_bytes_nano_config():
    """Nemotron 3 Nano 30B-A3B (docs/semantics.md): KV = 6 layers * 2 * 2 heads * 128 * 2 bytes = 6,144
    bytes per token in bf16; Mamba state = 23 * (64*64*128*4 + 6144*3*2) bytes (~46.8 MiB) per sequence."""
    config = HybridConfig.from_dict({
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "hidden_size": 2688, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "chunk_size": 128, "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "mamba_ssm_cache_dtype": "float32",
        "vocab_size": 131072, "torch_dtype": "bfloat16",
    })
    cache = BatchCache(config, 1, torch.bfloat16, "meta", capacity=1000)
    cache.begin(1, 1000, None)
    assert cache.kv_nbytes() == 6144 * 1000
    assert cache.state_nbytes() == 23 * (64 * 64 * 128 * 4 + 6144 * 3 * 2)
    assert abs(cache.state_nbytes() / 2**20 - 46.8) < 0.05


def test_the_model_reaches_its_state_only_through_the_cache_interface(checkpoint):
    """Prefill, a chunk and decode steps on a cache that offers nothing but the `Cache` interface give the
    logits of one full forward (the layers read and write their state only through `Cache.layer`)."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    ids = random_ids(11, ck.vocab_size, seed=5, batch=2)
    with torch.no_grad():
        ref = ck.ours(ids)
        cache = InterfaceOnly(ck.ours.new_cache(2))
        got = torch.cat([ck.ours(ids[:, :6], cache), ck.ours(ids[:, 6:9], cache), ck.ours(ids[:, 9:10], cache),
                         ck.ours(ids[:, 10:], cache)], 1)
    assert (got - ref).abs().max() <= TOL
    assert cache.calls["begin"] == 4 and cache.calls["layer"] == 4 * len(ck.ours.config.hybrid_override_pattern)
