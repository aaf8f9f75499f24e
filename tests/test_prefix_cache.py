"""Prefix caching of the hybrid state: a hit gives the logits and greedy tokens of a cold run, for every
way a prefix can end relative to the blocks, and the cache never leaks one request's decoding into another."""

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.prefix_cache import PrefixCache
from helpers import InterfaceOnly
from hybrid.cache import HybridCache
from tiny_checkpoint import random_model

BLOCK = 8  # TINY has conv_kernel 4 and chunk_size 8


@pytest.fixture(scope="module")
def model():
    return random_model("M*EM-E*", seed=3)


def ids(n, seed):
    return torch.randint(5, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt]))[0, -1]


@pytest.mark.parametrize("shared", [16, 13, 5, 2], ids=["on-boundary", "inside-block", "shorter-than-block",
                                                          "shorter-than-conv-kernel"])
def test_hit_equals_cold_run(model, shared):
    """Two requests share `shared` tokens, then diverge: the second reuses floor(shared / BLOCK) blocks and
    its logits and greedy tokens equal a run without the cache."""
    prefix = ids(shared, 0)
    first, second = prefix + ids(7, 1), prefix + ids(6, 2)
    cache = PrefixCache(model, block_size=BLOCK)
    generate_ids(model, [first], max_new_tokens=10, prefix_cache=cache)
    assert cache.match(second) == (shared // BLOCK) * BLOCK
    state, logits = cache.prefill(second)
    assert state.seq_len == len(second)
    assert torch.allclose(logits[0], cold_logits(model, second), atol=1e-5)
    (plain,) = generate_ids(model, [second], max_new_tokens=12)
    (hit,) = generate_ids(model, [second], max_new_tokens=12, prefix_cache=cache)
    assert hit.token_ids == plain.token_ids


def test_prompt_ending_on_a_block_boundary_keeps_one_token_to_run(model):
    """A prompt of exactly 3 blocks, already cached whole, reuses 2 blocks and recomputes the last."""
    prompt = ids(3 * BLOCK, 4)
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(prompt)
    assert len(cache) == 3
    assert cache.match(prompt) == 2 * BLOCK
    _, logits = cache.prefill(prompt)
    assert torch.allclose(logits[0], cold_logits(model, prompt), atol=1e-5)


def test_reuse_copies_the_snapshot(model):
    """A long decode after a hit does not change the snapshot: the same prompt again gives the same tokens."""
    prompt = ids(20, 5)
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(prompt)
    before = [t.clone() for node in cache._nodes.values() for pair in node.kv + node.mamba for t in pair]
    (a,) = generate_ids(model, [prompt], max_new_tokens=30, prefix_cache=cache)
    (b,) = generate_ids(model, [prompt], max_new_tokens=30, prefix_cache=cache)
    after = [t for node in cache._nodes.values() for pair in node.kv + node.mamba for t in pair]
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_cached_prefix_then_a_batch(model):
    """A system prefix cached once, then a batch of requests of different lengths that start with it (and
    one that does not): each row's greedy tokens equal the batch run without the cache."""
    system = ids(2 * BLOCK + 3, 6)
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(system)
    batch = [system + ids(4, 7), system + ids(11, 8), ids(9, 9)]
    plain = generate_ids(model, batch, max_new_tokens=10)
    hit = generate_ids(model, batch, max_new_tokens=10, prefix_cache=cache)
    assert [c.token_ids for c in hit] == [c.token_ids for c in plain]
    assert cache.hits == 2 and cache.reused_tokens == 2 * 2 * BLOCK


def test_snapshot_memory_and_lru_bound(model):
    """A node costs one Mamba state (constant) plus one block of KV; the byte bound evicts least recently
    used leaves, never a node whose children remain."""
    probe = model.new_cache(1)
    model(torch.tensor([ids(BLOCK, 0)]), probe)
    per_node = probe.state_nbytes() + probe.kv_nbytes()  # KV of exactly one block
    cache = PrefixCache(model, block_size=BLOCK, max_bytes=5 * per_node)
    a, b = ids(3 * BLOCK + 1, 10), ids(3 * BLOCK + 1, 11)
    cache.prefill(a)
    assert len(cache) == 3 and cache.nbytes == 3 * per_node
    cache.prefill(b)  # 6 nodes would exceed 5: a's leaf (least recently used) goes first
    assert len(cache) == 5 and cache.nbytes <= cache.max_bytes
    assert cache.match(b) == 3 * BLOCK and cache.match(a) == 2 * BLOCK
    assert all(n.children == sum(m.parent == n.digest for m in cache._nodes.values()) for n in cache._nodes.values())


def test_save_and_load(model, tmp_path):
    prompt = ids(2 * BLOCK + 5, 12)
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(prompt)
    cache.save(tmp_path / "prefix.safetensors")
    fresh = PrefixCache(model, block_size=BLOCK)
    assert fresh.load(tmp_path / "prefix.safetensors") == 2
    _, logits = fresh.prefill(prompt)
    assert fresh.hits == 1 and torch.allclose(logits[0], cold_logits(model, prompt), atol=1e-5)
    other = PrefixCache(random_model("M*EM-E*", seed=4), block_size=BLOCK)
    with pytest.raises(ValueError, match="another model"):
        other.load(tmp_path / "prefix.safetensors")
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(model, block_size=4).load(tmp_path / "prefix.safetensors")


def test_the_prefix_cache_uses_only_the_cache_interface(model, monkeypatch):
    """With every cache of the model offering nothing but the `Cache` interface, a hit still gives the logits
    and greedy tokens of a cold run: snapshots and restores go through `snapshot_kv`, `snapshot_mamba`,
    `restore` alone."""
    caches = []

    def new_cache(batch_size, capacity=0):
        caches.append(InterfaceOnly(HybridCache(model.config, batch_size, model.dtype, model.device, capacity)))
        return caches[-1]

    monkeypatch.setattr(model, "new_cache", new_cache)
    prefix = ids(20, 11)
    first, second = prefix + ids(5, 12), prefix + ids(4, 13)
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(first)
    state, logits = cache.prefill(second)
    assert cache.hits == 1 and cache.reused_tokens == 2 * BLOCK
    assert torch.allclose(logits[0], cold_logits(model, second), atol=1e-5)
    assert caches[0].calls["snapshot_kv"] == 3 and caches[1].calls["restore"] == 1
    (hit,) = generate_ids(model, [second], max_new_tokens=8, prefix_cache=cache)
    monkeypatch.undo()
    (plain,) = generate_ids(model, [second], max_new_tokens=8)
    assert hit.token_ids == plain.token_ids
