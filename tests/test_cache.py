"""The inference cache (`HybridCache`): every way of feeding tokens through it equals one full forward.

Oracles: our own model run in one pass without a cache (itself checked against transformers in
test_parity.py), each row of a padded batch run alone, and hand-computed byte counts.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hybrid.cache import HybridCache
from hybrid.config import HybridConfig
from helpers import InterfaceOnly, random_ids

CACHE_CONFIGS = ["all4_ng2_gqa4_c8", "ngnh_mqa_c8_k2", "chunk64_ng2", "nano_like_c16"]
# fp32 rounding only: different chunkings / batchings sum in other orders. Logits are O(1..5) here and
# pass through up to 7 layers, so differences are ~1e-6..2e-5; a real fault is >= 1e-2.
TOL = 5e-5


def feed(model, ids: torch.Tensor, sizes: list[int], mask=None) -> tuple[torch.Tensor, HybridCache]:
    """Feed ids [B, T] through one cache in segments of `sizes`; the logits of every position."""
    cache = model.new_cache(ids.shape[0])
    outs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            seg_mask = None if mask is None else mask[:, start : start + n]
            outs.append(model(ids[:, start : start + n], cache=cache, attention_mask=seg_mask))
            start += n
    return torch.cat(outs, 1), cache


def pad(prompts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        sl = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = p, 1
    return ids, mask


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
def test_left_padded_batch_equals_rows_alone(checkpoint, config):
    """Left-padded prefill, then a multi-token segment (chunked path over a cache holding pads), then
    single-token decode: each row's logits equal the row alone at every real position."""
    ck = checkpoint(config)
    lengths = [1, 5, ck.chunk_size + 2, 2 * ck.chunk_size + 1]
    prompts = [random_ids(n, ck.vocab_size, seed=70 + n)[0] for n in lengths]
    ids, mask = pad(prompts, "left")
    tail = random_ids(7, ck.vocab_size, seed=71, batch=len(prompts))  # 5-token segment + 2 single steps
    logits, _ = feed(ck.ours, torch.cat([ids, tail], 1), [ids.shape[1], 5, 1, 1],
                     mask=torch.cat([mask, torch.ones_like(tail)], 1))
    for i, p in enumerate(prompts):
        alone, _ = feed(ck.ours, torch.cat([p[None], tail[i : i + 1]], 1), [len(p), 5, 1, 1])
        real = logits[i, ids.shape[1] - len(p) :]
        diff = (real - alone[0]).abs().max()
        assert diff <= TOL, f"row {i} (length {len(p)}): max diff {diff:.3g}"


@pytest.mark.parametrize("config", ["ngnh_mqa_c8_k2", "chunk64_ng2", "nano_like_c16"])
def test_right_padded_prefill_caches_the_right_state(checkpoint, config):
    """After a right-padded prefill each row's Mamba state (conv window, SSM state) and real keys/values
    equal the row's alone; the cache marks the pads; the continuation equals the row alone."""
    ck = checkpoint(config)
    K1 = ck.ours.config.conv_kernel - 1
    lengths = [1, K1, ck.chunk_size - 1, ck.chunk_size + 4]
    prompts = [random_ids(n, ck.vocab_size, seed=80 + n)[0] for n in lengths]
    ids, mask = pad(prompts, "right")
    cache = ck.ours.new_cache(len(prompts))
    with torch.no_grad():
        ck.ours(ids, cache=cache, attention_mask=mask)
    assert torch.equal(cache.key_mask, mask.bool())
    after_prefill = copy.deepcopy(cache.layers)
    tail = random_ids(4, ck.vocab_size, seed=81, batch=len(prompts))
    with torch.no_grad():  # a 3-token segment then one decode step, on the padded cache
        after = torch.cat([ck.ours(tail[:, :3], cache=cache), ck.ours(tail[:, 3:], cache=cache)], 1)
    for i, p in enumerate(prompts):
        alone = ck.ours.new_cache(1)
        with torch.no_grad():
            ck.ours(p[None], cache=alone)
        for ours, ref in zip(after_prefill, alone.layers):
            if hasattr(ours, "ssm"):
                assert torch.allclose(ours.conv[i], ref.conv[0], atol=TOL)
                assert torch.allclose(ours.ssm[i], ref.ssm[0], atol=TOL)
            elif hasattr(ours, "k"):
                assert torch.allclose(ours.k[i, :, : len(p)], ref.k[0, :, : len(p)], atol=TOL)
                assert torch.allclose(ours.v[i, :, : len(p)], ref.v[0, :, : len(p)], atol=TOL)
        with torch.no_grad():
            ref_after = torch.cat([ck.ours(tail[i : i + 1, :3], cache=alone), ck.ours(tail[i : i + 1, 3:], cache=alone)], 1)
        assert (after[i] - ref_after[0]).abs().max() <= TOL, f"row {i}: continuation differs"


def test_attention_mask_may_cover_past_and_new_tokens(checkpoint):
    """transformers passes attention_mask as [B, past + T]; it means the same as its last T columns."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    ids, mask = pad([random_ids(n, ck.vocab_size, seed=n)[0] for n in (4, 9)], "left")
    step = random_ids(1, ck.vocab_size, seed=3, batch=2)
    a, b = ck.ours.new_cache(2), ck.ours.new_cache(2)
    with torch.no_grad():
        ck.ours(ids, cache=a, attention_mask=mask)
        ck.ours(ids, cache=b, attention_mask=mask)
        la = ck.ours(step, cache=a, attention_mask=torch.ones(2, 1, dtype=torch.long))
        lb = ck.ours(step, cache=b, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    assert torch.equal(la, lb)
    with pytest.raises(ValueError):
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
    cache = HybridCache(config, 1, dtype=torch.bfloat16, device="meta", capacity=1000)
    cache.begin(1, 1000, None)
    assert cache.kv_nbytes() == 6144 * 1000
    assert cache.state_nbytes() == 23 * (64 * 64 * 128 * 4 + 6144 * 3 * 2)
    assert abs(cache.state_nbytes() / 2**20 - 46.8) < 0.05


def test_masked_decode_step_leaves_the_row_untouched(checkpoint):
    """A padding token fed during decode (mask 0, e.g. a finished row of a batch) changes nothing for that
    row: its Mamba state stays the same and its next real token gives the logits of a run without it."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    model = ck.ours
    ids = random_ids(10, ck.vocab_size, seed=91, batch=2)
    a, b = model.new_cache(2), model.new_cache(2)
    with torch.no_grad():
        model(ids, cache=a)
        model(ids, cache=b)
        before = copy.deepcopy(a.layers)
        model(torch.tensor([[5], [6]]), cache=a, attention_mask=torch.tensor([[0], [1]]))  # row 0: a pad
        for ours, ref in zip(a.layers, before):
            if hasattr(ours, "ssm"):
                assert torch.equal(ours.conv[0], ref.conv[0]) and torch.equal(ours.ssm[0], ref.ssm[0])
        model(torch.tensor([[5], [6]]), cache=b)  # the same step with row 0 real
        nxt = torch.tensor([[7], [8]])
        la, lb = model(nxt, cache=a)[0], model(nxt, cache=b)[0]
    alone = model.new_cache(1)
    with torch.no_grad():
        model(ids[:1], cache=alone)
        ref = model(nxt[:1], cache=alone)[0]
    assert (la[0] - ref[0]).abs().max() <= TOL  # row 0 as if the pad never came
    assert (lb[0] - ref[0]).abs().max() > 1e-3  # (feeding the token for real does change it)


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
