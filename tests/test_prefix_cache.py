"""Prefix caching on the serving engine (`hybrid.prefix_cache.PrefixCache`): a hit gives the greedy tokens of
a cold run (`generate_ids` without a cache) and resumes at the expected snapshot (a multiple of the snapshot
interval, or an earlier prompt's exact end); decoding after a hit never changes what a later request sees;
snapshots are bounded in bytes, least recently used first; saved files round-trip, and every malformed file
is refused with `PrefixCacheFileError` naming the file (and the entry) and adds nothing."""

import json
import re

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.prefix_cache import PrefixCache, PrefixCacheFileError
from hybrid.sampling import SamplingParams
from hybrid.serving.engine import Engine
from tiny_checkpoint import random_model, write_checkpoint

BS = 16  # KV block size (the engine's default); the checkpoint's chunk_size is 16 as well
VOCAB = 96  # the `checkpoint` fixture's vocabulary


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("nano_like_c16").ours  # "MEM*EM-": 3 Mamba layers, 1 attention layer (1 KV head), fp32


def ids(n, seed):
    return torch.randint(5, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold(model, prompt, n=8, sampling=None):
    (c,) = generate_ids(model, [prompt], max_new_tokens=n, sampling=sampling)
    return c.token_ids


def cache(model, interval=BS, **kwargs):
    return PrefixCache(model, snapshot_interval=interval, **kwargs)


def block_bytes(model):
    c = model.config
    return 2 * c.hybrid_override_pattern.count("*") * BS * c.num_key_value_heads * c.head_dim * 4  # fp32


# ---------------------------------------------------------------------------------------------- hits
@pytest.mark.parametrize("interval,shared", [(16, 32), (16, 29), (16, 5), (16, 2), (32, 40), (32, 31)],
                         ids=["on-snapshot", "inside-interval", "shorter-than-block", "shorter-than-conv-kernel",
                              "interval-32", "interval-32-below"])
def test_hit_equals_cold_run(model, interval, shared):
    """Two prompts share `shared` tokens, then diverge: the second resumes at the last snapshot inside the
    shared part (the largest multiple of the interval at most `shared`) and its greedy tokens equal a cold run."""
    prefix = ids(shared, 0)
    first, second = prefix + ids(7, 1), prefix + ids(6, 2)
    pc = cache(model, interval)
    (c,) = pc.generate([first], 6)
    assert c.token_ids == cold(model, first, 6) and c.cached_tokens == 0
    expected = shared // interval * interval
    assert pc.match(second) == expected
    (hit,) = generate_ids(model, [second], max_new_tokens=8, prefix_cache=pc)
    assert hit.cached_tokens == expected and hit.token_ids == cold(model, second, 8)
    assert (pc.hits, pc.misses, pc.reused_tokens) == (int(expected > 0), 2 - int(expected > 0), expected)
    # the prefill rate counts the prompt tokens computed, not those taken from the cache
    assert hit.prefill_tokens_per_s == pytest.approx((len(second) - expected) / hit.prefill_seconds)


def test_a_prompt_extending_an_earlier_one_resumes_at_its_end(model):
    """Turn 2 of a conversation: a prompt that starts with a whole earlier prompt (35 tokens: not a snapshot
    interval multiple) resumes exactly at its end, from the snapshot taken there with its partial block's KV."""
    turn1 = ids(2 * BS + 3, 3)
    pc = cache(model)
    pc.generate([turn1], 4)
    turn2 = turn1 + ids(9, 4)
    assert pc.match(turn2) == len(turn1)
    (c,) = pc.generate([turn2], 8)
    assert c.cached_tokens == len(turn1) and c.token_ids == cold(model, turn2, 8)
    turn3 = turn2 + ids(4, 5)  # and again from turn 2's end (inside the third block)
    (c,) = pc.generate([turn3], 8)
    assert c.cached_tokens == len(turn2) and c.token_ids == cold(model, turn3, 8)


def test_a_seeded_sampled_hit_equals_the_cold_run(model):
    prompt = ids(40, 6)
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=3)
    pc = cache(model)
    pc.generate([prompt], 1)
    (hit,) = generate_ids(model, [prompt], max_new_tokens=8, sampling=sampling, prefix_cache=pc)
    assert hit.cached_tokens == 40 and hit.token_ids == cold(model, prompt, 8, sampling)  # the whole prompt


def test_a_prompt_cached_whole_computes_nothing_and_samples_from_the_kept_hidden_state(model):
    """A prompt sent again (here exactly 3 blocks, or one token) resumes from the snapshot at its end, whole:
    its first token's logits come from the final hidden state kept with the snapshot. Without a kept hidden
    state the last token must run, so it resumes one interval earlier. Either way the tokens are a cold run's."""
    prompt = ids(3 * BS, 7)
    pc = cache(model)
    pc.generate([prompt], 1)
    assert len(pc) == 3  # at 16, 32 and 48 (the prompt's end)
    assert pc.match(prompt) == 3 * BS and pc.match(prompt + [5]) == 3 * BS and pc.match(prompt[:40]) == 2 * BS
    (c,) = pc.generate([prompt], 8)
    assert c.cached_tokens == len(prompt) and c.token_ids == cold(model, prompt)
    (c,) = pc.generate([prompt[:2 * BS]], 8)  # ends on the snapshot at 32, taken inside the longer prompt
    assert c.cached_tokens == 2 * BS and c.token_ids == cold(model, prompt[:2 * BS])
    single = ids(1, 8)
    pc.generate([single], 1)
    assert pc.match(single) == 1 and pc.generate([single], 3)[0].token_ids == cold(model, single, 3)
    for snapshot in pc._prefix.snapshots.values():
        snapshot.last_hidden = None
    assert pc.match(prompt) == 2 * BS and pc.match(single) == 0
    (c,) = pc.generate([prompt], 8)
    assert c.cached_tokens == 2 * BS and c.token_ids == cold(model, prompt)


def test_a_hit_overwrites_its_whole_slot_and_a_miss_starts_from_zero(model):
    """A resumed request's slot is not zeroed (the snapshot's states overwrite all of it), a fresh one's is: with NaN
    left in every slot, a hit and a miss both give the cold run's tokens."""
    prompt = ids(2 * BS + 3, 11)
    pc = cache(model)
    pc.generate([prompt], 1)
    slots = pc.engine.slots
    for t in slots.conv + slots.ssm:
        t.fill_(float("nan"))
    extended, fresh = prompt + ids(5, 12), ids(2 * BS + 3, 13)
    (hit,) = pc.generate([extended], 8)
    assert hit.cached_tokens == len(prompt) and hit.token_ids == cold(model, extended)
    for t in slots.conv + slots.ssm:
        t.fill_(float("nan"))
    (miss,) = pc.generate([fresh], 8)
    assert miss.cached_tokens == 0 and miss.token_ids == cold(model, fresh)


def test_reuse_never_aliases(model):
    """A long decode after a hit (past several blocks) changes neither the snapshots nor the KV of any named
    block: the same prompt three times gives the cold run's tokens each time."""
    prompt = ids(37, 9)
    pc = cache(model)
    pc.generate([prompt], 1)
    prefix, pool = pc._prefix, pc.engine.blocks
    snapshots = {key: [t.clone() for pair in s.mamba + s.tail_kv for t in pair] + [s.last_hidden.clone()]
                 for key, s in prefix.snapshots.items()}
    kv = {name.digest: [t[b].clone() for t in pool.k + pool.v] for b, name in pool.named()}
    expected = cold(model, prompt, 30)  # to position 67: two more blocks written after the hit
    runs = [pc.generate([prompt], 30)[0] for _ in range(3)]
    assert [r.token_ids for r in runs] == [expected] * 3 and [r.cached_tokens for r in runs] == [37] * 3
    for key, before in snapshots.items():
        s = prefix.snapshots[key]
        after = [t for pair in s.mamba + s.tail_kv for t in pair] + [s.last_hidden]
        assert len(before) == len(after) and all(torch.equal(x, y) for x, y in zip(before, after))
    for digest, before in kv.items():
        b = pool.find(digest)
        assert b is not None and all(torch.equal(x, t[b]) for x, t in zip(before, pool.k + pool.v))


def test_cached_prefix_then_a_batch(model):
    """A system prefix cached once, then a batch that extends it by different lengths, shares only part of it,
    or does not start with it: each row equals its own cold run and resumes where expected."""
    system = ids(2 * BS + 3, 10)
    pc = cache(model)
    pc.generate([system], 1)
    batch = [system + ids(4, 11), ids(9, 12), system + ids(11, 13), system[:20] + ids(7, 14)]
    got = generate_ids(model, batch, max_new_tokens=8, prefix_cache=pc)
    assert [c.token_ids for c in got] == [cold(model, p, 8) for p in batch]
    assert [c.cached_tokens for c in got] == [35, 0, 35, 16]
    assert pc.hits == 3 and pc.reused_tokens == 35 + 35 + 16


# ---------------------------------------------------------------------------------------------- memory
def test_snapshot_memory_bound_and_lru(model):
    """A snapshot without a partial block weighs one Mamba state and one hidden state; `max_bytes` holds three,
    evicting the least recently used (a hit refreshes one); the blocks stay in the pool but an evicted snapshot
    no longer matches."""
    state = model.new_cache(1).state_nbytes() + model.config.hidden_size * 4  # fp32
    pc = cache(model, max_bytes=3 * state)

    def snapshot_bytes():
        return pc.nbytes - pc.engine.blocks.num_cached() * block_bytes(model)

    A, B, C = ids(32, 20), ids(32, 21), ids(32, 22)
    pc.generate([A], 1)  # A16, A32
    assert len(pc) == 2 and snapshot_bytes() == 2 * state and pc.match(A[:20]) == 16
    pc.generate([B], 1)  # B16, B32: A16 evicted
    assert len(pc) == 3 and snapshot_bytes() == 3 * state
    assert pc.match(A[:20]) == 0 and pc.match(A + [5]) == 32 and pc.match(B[:20]) == 16 and pc.match(B + [5]) == 32
    (c,) = pc.generate([A + ids(16, 23)], 1)  # resumes at A32 (now most recent); A48 evicts B16
    assert c.cached_tokens == 32 and len(pc) == 3
    assert pc.match(B[:20]) == 0 and pc.match(B + [5]) == 32
    pc.generate([C], 1)  # C16, C32 evict B32 and A32, not A48
    assert len(pc) == 3 and snapshot_bytes() == 3 * state <= pc.nbytes
    assert pc.match(B + [5]) == 0 and pc.match(A + [5]) == 0 and pc.match(A + ids(16, 23) + [5]) == 48
    assert pc.match(C + [5]) == 32
    for prompt in (B + [5], A + ids(16, 23) + [5]):  # a miss and a hit after evictions still equal cold runs
        assert pc.generate([prompt], 6)[0].token_ids == cold(model, prompt, 6)


def test_a_bound_below_one_snapshot_keeps_none(model):
    prompt = ids(40, 24)
    pc = cache(model, max_bytes=model.new_cache(1).state_nbytes() - 1)
    pc.generate([prompt], 1)
    (c,) = pc.generate([prompt], 6)
    assert len(pc) == 0 and pc.hits == 0 and c.cached_tokens == 0 and c.token_ids == cold(model, prompt, 6)
    assert pc.nbytes == pc.engine.blocks.num_cached() * block_bytes(model)  # the blocks alone
    with pytest.raises(ValueError, match="multiple of the block size"):
        cache(model, interval=20)
    with pytest.raises(ValueError, match="max_bytes"):
        cache(model, max_bytes=-1)


# ---------------------------------------------------------------------------------------------- save and load
def test_save_and_load(model, tmp_path):
    prompts = [ids(2 * BS + 5, 30), ids(BS + 3, 31)]
    pc = cache(model)
    for p in prompts:
        pc.generate([p], 4)
    store = tmp_path / "prefix.safetensors"
    pc.save(store)
    fresh = cache(model)
    assert fresh.load(store) == len(pc) == len(fresh) == 5 and fresh.nbytes == pc.nbytes
    assert fresh.load(store) == 0 and len(fresh) == 5  # loading again adds nothing new
    for p in prompts:
        q = p + ids(5, 32)
        assert fresh.match(q) == len(p)
        (c,) = fresh.generate([q], 8)
        assert c.cached_tokens == len(p) and c.token_ids == cold(model, q, 8)
    assert fresh.hits == 2 and fresh.misses == 0
    other_interval = cache(model, interval=32)  # the interval is not part of the file: its snapshots serve as well
    assert other_interval.load(store) == 5 and other_interval.match(prompts[0] + [5]) == len(prompts[0])
    with pytest.raises(PrefixCacheFileError, match="block_size 16 differs from 32"):
        PrefixCache(model, snapshot_interval=32, block_size=32).load(store)
    cache(model).save(tmp_path / "empty.safetensors")  # an empty cache saves a file that loads nothing
    assert cache(model).load(tmp_path / "empty.safetensors") == 0


def test_loaded_prefixes_lose_their_tails_first(model, tmp_path):
    """A loaded prefix that a later request partly evicts keeps its head, as one cached in this process does:
    40 blocks (of 4 tokens) cached in a fixed 64-block pool, then a 30-block prompt takes 6 of them, the last."""
    A, B = ids(40 * 4, 50), ids(30 * 4, 51)
    here = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=16)
    here.generate([A], max_tokens=1)
    here.save_prefix_cache(tmp_path / "a.safetensors")
    here.generate([B], max_tokens=1)
    assert here.prefix.match(A + [5]) == 128  # blocks 0-33 kept: the last snapshot in them
    loaded = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=16)
    loaded.load_prefix_cache(tmp_path / "a.safetensors")
    loaded.generate([B], max_tokens=1)
    assert loaded.prefix.match(A + [5]) == 128


def test_an_unrelated_prompt_does_not_evict_a_prefix_within_the_budget(model):
    """The cache's pool grows rather than hand out cached blocks while snapshots and cached KV fit
    max_bytes; past it, the least recently used go."""
    A, B = ids(640, 52), ids(640, 53)
    pc = PrefixCache(model)
    pc.generate([A], 1)
    pc.generate([B], 1)
    assert pc.match(A + [5]) == 640 and pc.match(B + [5]) == 640
    one = pc.engine.slots.slot_nbytes()
    small = PrefixCache(model, max_bytes=4 * one)
    small.generate([A], 1)
    small.generate([B], 1)
    assert small.match(B + [5]) == 640 and small.match(A + [5]) < 640


def test_queries_count_admissions_not_attempts(model):
    engine = Engine(model, num_blocks=8, block_size=16, max_num_seqs=2, prefix_caching=True, snapshot_interval=16)
    engine.generate([ids(100, 54), ids(100, 55)], max_tokens=2)  # the second waits for blocks for steps
    assert engine.prefix.queries == 2 + engine.scheduler.num_preemptions


def test_a_prefix_cache_of_another_model_is_refused(model, checkpoint):
    pc = cache(model)
    with pytest.raises(ValueError, match="another model"):
        generate_ids(checkpoint("all4_ng2_gqa4_c8").ours, [ids(20, 56)], 4, prefix_cache=pc)


def test_a_load_into_a_full_pool_counts_only_usable_snapshots(model, tmp_path):
    """Only the blocks that fit are loaded (parents first), and only snapshots on them are kept."""
    doc = ids(40, 57)
    source = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=8)
    source.generate([doc + [5]], max_tokens=1)
    source.save_prefix_cache(tmp_path / "d.safetensors")
    small = Engine(model, num_blocks=12, block_size=4, prefix_caching=True, snapshot_interval=8)
    held = small.add_request(ids(30, 58), None, 20)
    while small.requests[held].num_computed < 30:
        small.step()  # its prompt in 8 of the 12 blocks
    assert small.blocks.num_free == 4
    own = len(small.prefix.snapshots)
    added = small.load_prefix_cache(tmp_path / "d.safetensors")
    assert added == 2 and len(small.prefix.snapshots) == own + 2  # the snapshots at 8 and 16: 4 blocks fit
    assert small.prefix.match(doc + [5]) == 16
    small.abort(held)


def test_one_changed_weight_element_in_an_expert_bank_makes_the_old_file_stale(tmp_path):
    """The file of a model whose expert bank then changes by one element in the middle of one expert is
    refused as another model's; the model's own file still loads."""
    import hybrid

    source = tmp_path / "model"
    hybrid.save_checkpoint(random_model("M*E", seed=5, hidden_size=64, moe_intermediate_size=512,
                                        n_routed_experts=4), source)
    model = hybrid.load_model(source)
    pc = cache(model)
    pc.generate([ids(2 * BS + 3, 33)], 1)
    store = tmp_path / "prefix.safetensors"
    pc.save(store)
    with torch.no_grad():  # expert 2's up_proj [512, 64] fp32 is 128 KiB: element (100, 10) at byte 25,640
        model.backbone.layers[2].mixer.experts.up_proj[2, 100, 10] += 2 ** -20
    hybrid.save_checkpoint(model, tmp_path / "changed")
    changed = cache(hybrid.load_model(tmp_path / "changed"))
    with pytest.raises(PrefixCacheFileError, match="another model") as e:
        changed.load(store)
    assert str(e.value).startswith(f"{store}: ") and len(changed) == 0
    assert cache(hybrid.load_model(source)).load(store) == 3


def test_a_failed_save_leaves_the_previous_file(model, tmp_path, monkeypatch):
    import safetensors.torch

    store = tmp_path / "prefix.safetensors"
    pc = cache(model)
    pc.generate([ids(20, 34)], 1)
    pc.save(store)
    before = store.read_bytes()

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    pc.generate([ids(50, 35)], 1)
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pc.save(store)
    assert store.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["prefix.safetensors"]
    monkeypatch.undo()
    assert cache(model).load(store) == 2


# ---------------------------------------------------------------------------------------------- bad files
SAVED = ids(2 * BS + 5, 40)  # the saved prompt: blocks [0: parent -1, 1: parent 0], snapshots 16, 32, 37 (tail 5)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """(path, metadata, tensors) of a real saved file."""
    from safetensors import safe_open

    pc = cache(model)
    pc.generate([SAVED], 1)
    path = tmp_path_factory.mktemp("saved") / "prefix.safetensors"
    pc.save(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert json.loads(meta["snapshots"])[2] == {"parent": 1, "tail": SAVED[32:]}
    return path, meta, tensors


def rewrite(saved, path, meta=None, tensors=None):
    """Write `saved` to `path` with metadata entries replaced by `meta` (a value of None drops the key) and the
    tensors changed by `tensors` (a function of the dict)."""
    from safetensors.torch import save_file

    _, old_meta, old_tensors = saved
    new_meta = {k: v for k, v in {**old_meta, **(meta or {})}.items() if v is not None}
    new_tensors = dict(old_tensors) if tensors is None else tensors(dict(old_tensors))
    save_file(new_tensors, str(path), metadata=new_meta)
    return path


@pytest.fixture
def receiver(model):
    """A cache that already holds an unrelated prefix: a refused file must leave it exactly as it was."""
    pc = cache(model)
    pc.generate([ids(30, 41)], 1)
    return pc


def assert_refused(receiver, path, match):
    before = (len(receiver), receiver.nbytes, receiver.engine.blocks.num_cached())
    with pytest.raises(PrefixCacheFileError) as e:
        receiver.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and re.search(match, message), message
    assert (len(receiver), receiver.nbytes, receiver.engine.blocks.num_cached()) == before
    assert receiver.match(SAVED + [5]) == 0 and receiver.match(SAVED[:20]) == 0
    return message


@pytest.mark.parametrize("kind", ["cut-short", "not-safetensors", "empty", "header-only", "missing", "directory"])
def test_an_unreadable_file_is_refused_and_adds_nothing(saved, receiver, tmp_path, kind):
    data = saved[0].read_bytes()
    path = tmp_path / "prefix.safetensors"
    content = {"cut-short": data[:len(data) - 100], "not-safetensors": b"GGUF" + bytes(200), "empty": b"",
               "header-only": data[:8]}.get(kind)
    if content is not None:
        path.write_bytes(content)
    elif kind == "directory":
        path.mkdir()
    assert_refused(receiver, path, "not a readable prefix-cache file")


@pytest.mark.parametrize("meta,match", [
    ({"format": "other"}, r"not a prefix-cache file of this project \(format 'other'"),
    ({"format": None}, r"format 'missing'"),
    ({"format": None, "blocks": None, "snapshots": None, "nodes": "[]"}, "files of the earlier copy-based cache"),
    ({"version": "1"}, r"prefix-cache file version '1'; this version reads '2'"),
    ({"version": None}, r"version 'None'"),
    ({"identity": "0" * 64}, "written for another model"),
    ({"block_size": "8"}, "block_size 8 differs from 16"),
    ({"block_size": None}, "block_size None differs from 16"),
    ({"blocks": None}, r"its blocks list \(metadata 'blocks'\) is not JSON"),
], ids=["format", "no-format", "old-copy-based", "version", "no-version", "identity", "block-size", "no-block-size",
        "no-blocks"])
def test_a_file_of_another_format_model_or_block_size_is_refused(saved, receiver, tmp_path, meta, match):
    assert_refused(receiver, rewrite(saved, tmp_path / "bad.safetensors", meta), match)


def _with(entries, i, **change):
    out = [dict(x) for x in entries]
    out[i] = {k: v for k, v in {**out[i], **change}.items() if v is not None}
    return out


BLOCKS_CASES = {  # name: (new blocks list from the saved one, or a raw string; message)
    "not-json": ("[{", r"its blocks list \(metadata 'blocks'\) is not JSON"),
    "too-deep": ("[" * 5000, r"its blocks list \(metadata 'blocks'\) is not JSON"),
    "not-a-list": ('{"parent": -1}', "its blocks list is not a list of"),
    "entry-not-a-dict": (lambda e: [e[0], [1, 2]], r"its blocks list is not a list of .*\(entry 1"),
    "no-parent": (lambda e: _with(e, 1, parent=None), r"not a list of .*\(entry 1"),
    "no-tokens": (lambda e: _with(e, 1, tokens=None), r"not a list of .*\(entry 1"),
    "tokens-not-a-list": (lambda e: _with(e, 1, tokens="abc"), r"not a list of .*\(entry 1"),
    "parent-not-int": (lambda e: _with(e, 1, parent="0"), r"not a list of .*\(entry 1"),
    "parent-float": (lambda e: _with(e, 1, parent=0.0), r"not a list of .*\(entry 1"),
    "parent-bool": (lambda e: _with(e, 1, parent=False), r"not a list of .*\(entry 1"),  # False == 0 is earlier
    "parent-not-earlier": (lambda e: _with(e, 1, parent=1), r"blocks entry 1: parent 1 is not an earlier block"),
    "parents-swapped": (lambda e: [e[1], e[0]], r"blocks entry 0: parent 0 is not an earlier block"),
    "parent-out-of-range": (lambda e: _with(e, 1, parent=-2), r"blocks entry 1: parent -2 is not an earlier"),
    "parent-huge": (lambda e: _with(e, 1, parent=10 ** 30), r"blocks entry 1: parent 1000000000000000000000000000000"),
    "tokens-short": (lambda e: _with(e, 1, tokens=e[1]["tokens"][:-1]),
                     r"blocks entry 1 has 15 token ids, expected block_size = 16"),
    "tokens-long": (lambda e: _with(e, 1, tokens=e[1]["tokens"] + [5]), r"blocks entry 1 has 17 token ids"),
    "id-past-vocab": (lambda e: _with(e, 1, tokens=[VOCAB] + e[1]["tokens"][1:]),
                      r"blocks entry 1 holds 96, not a token id in \[0, 96\)"),
    "id-negative": (lambda e: _with(e, 1, tokens=e[1]["tokens"][:-1] + [-1]), r"blocks entry 1 holds -1"),
    "id-bool": (lambda e: _with(e, 1, tokens=[True] + e[1]["tokens"][1:]), r"blocks entry 1 holds True"),
    "id-float": (lambda e: _with(e, 1, tokens=[5.0] + e[1]["tokens"][1:]), r"blocks entry 1 holds 5\.0"),
    "id-huge": ('[{"parent": -1, "tokens": [' + "1" * 5000 + "]}]",
                r"its blocks list \(metadata 'blocks'\) is not JSON"),
    "extra-entry": (lambda e: e + [{"parent": 1, "tokens": e[0]["tokens"]}], "missing tensor block.2.0.k"),
}

SNAPSHOTS_CASES = {
    "not-json": ("[{", r"its snapshots list \(metadata 'snapshots'\) is not JSON"),
    "not-a-list": ("5", "its snapshots list is not a list of"),
    "entry-not-a-dict": (lambda s: s[:2] + ["tail"], r"its snapshots list is not a list of .*\(entry 2"),
    "no-tail": (lambda s: _with(s, 2, tail=None), r"not a list of .*\(entry 2"),
    "parent-bool": (lambda s: _with(s, 2, parent=True), r"not a list of .*\(entry 2"),
    "parent-past-the-blocks": (lambda s: _with(s, 2, parent=2),
                               r"snapshots entry 2: parent 2 is not a block of the file"),
    "parent-out-of-range": (lambda s: _with(s, 2, parent=-2), r"snapshots entry 2: parent -2 is not a block"),
    "tail-of-block-size": (lambda s: _with(s, 2, tail=ids(BS, 42)),
                           r"snapshots entry 2 has 16 token ids, expected fewer than block_size = 16"),
    "id-past-vocab": (lambda s: _with(s, 2, tail=s[2]["tail"][:-1] + [VOCAB]), r"snapshots entry 2 holds 96"),
    "tail-of-another-length": (lambda s: _with(s, 2, tail=s[2]["tail"][:-1]),
                               r"tensor snapshot\.2\.kv\.0\.k is \(1, 5, 8\) torch\.float32, this model's are "
                               r"\(1, 4, 8\) torch\.float32"),
    "empty": (lambda s: s[:2] + [{"parent": -1, "tail": []}], r"snapshots entry 2 holds no tokens"),
    "extra-entry": (lambda s: s + [s[0]], "missing tensor snapshot.3.mamba.0.conv"),
}


@pytest.mark.parametrize("key,case", [("blocks", c) for c in BLOCKS_CASES]
                         + [("snapshots", c) for c in SNAPSHOTS_CASES])
def test_a_malformed_list_is_refused_naming_the_file_and_entry(saved, receiver, tmp_path, key, case):
    """Every malformed blocks or snapshots list raises PrefixCacheFileError naming the file and the entry, and
    adds nothing (the entries before the bad one were fine)."""
    change, match = (BLOCKS_CASES if key == "blocks" else SNAPSHOTS_CASES)[case]
    value = change if isinstance(change, str) else json.dumps(change(json.loads(saved[1][key])))
    assert_refused(receiver, rewrite(saved, tmp_path / "bad.safetensors", {key: value}), match)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _replace(name, f):
    return lambda t: {**t, name: f(t[name]).contiguous()}


@pytest.mark.parametrize("tensors,match", [
    (_drop("block.1.0.v"), "missing tensor block.1.0.v"),
    (_drop("snapshot.2.mamba.2.ssm"), "missing tensor snapshot.2.mamba.2.ssm"),
    (_drop("snapshot.2.kv.0.k"), "missing tensor snapshot.2.kv.0.k"),
    (_replace("block.1.0.k", lambda x: x[:-1]), r"tensor block\.1\.0\.k is \(15, 1, 8\) torch\.float32, this "
                                                r"model's are \(16, 1, 8\) torch\.float32"),
    (_replace("snapshot.2.mamba.1.conv", lambda x: x[..., :-1]), r"tensor snapshot\.2\.mamba\.1\.conv is"),
    (_replace("snapshot.2.kv.0.v", lambda x: x[None]), r"tensor snapshot\.2\.kv\.0\.v is \(1, 1, 5, 8\)"),
    (_replace("block.1.0.v", lambda x: x.double()), r"tensor block\.1\.0\.v is \(16, 1, 8\) torch\.float64"),
    (_replace("snapshot.2.mamba.0.ssm", lambda x: x.bfloat16()), r"snapshot\.2\.mamba\.0\.ssm is .* torch\.bfloat16"),
], ids=["no-block-v", "no-ssm", "no-tail-k", "block-shape", "conv-shape", "tail-rank", "block-dtype", "ssm-dtype"])
def test_a_missing_tensor_or_one_of_another_shape_or_dtype_is_refused(saved, receiver, tmp_path, tensors, match):
    assert_refused(receiver, rewrite(saved, tmp_path / "bad.safetensors", tensors=tensors), match)


def test_any_entry_lists_either_load_or_are_refused(model, saved, tmp_path):
    """Property: blocks and snapshots lists made of the file's entries, edited parents (earlier, later, out of
    range, bools) and edited token lists either load, and then every snapshot of the file matches its own
    prefix exactly, or raise PrefixCacheFileError and add nothing."""
    from hypothesis import given, strategies as st

    blocks, snaps = json.loads(saved[1]["blocks"]), json.loads(saved[1]["snapshots"])
    tokens = st.sampled_from([blocks[0]["tokens"], blocks[1]["tokens"], blocks[1]["tokens"][:-1],
                              [VOCAB] + blocks[0]["tokens"][1:]])
    tails = st.sampled_from([[], snaps[2]["tail"], snaps[2]["tail"][:3], ids(BS, 43), [True]])
    parent = st.one_of(st.integers(-2, 3), st.booleans())
    block = st.one_of(st.fixed_dictionaries({"parent": parent, "tokens": tokens}), st.just([1]))
    snapshot = st.fixed_dictionaries({"parent": parent, "tail": tails})
    target = tmp_path / "edited.safetensors"
    outcomes = set()

    @given(st.lists(block, max_size=3), st.lists(snapshot, max_size=4))
    def check(block_list, snapshot_list):
        rewrite(saved, target, {"blocks": json.dumps(block_list), "snapshots": json.dumps(snapshot_list)})
        fresh = cache(model)
        try:
            added = fresh.load(target)
        except PrefixCacheFileError as e:
            assert str(e).startswith(f"{target}: ")
            assert len(fresh) == 0 and fresh.nbytes == 0
            outcomes.add("refused")
            return
        outcomes.add("loaded")
        prefixes = []
        for b in block_list:
            prefixes.append((prefixes[b["parent"]] if b["parent"] >= 0 else []) + b["tokens"])
        keys = set()
        for s in snapshot_list:
            p = (prefixes[s["parent"]] if s["parent"] >= 0 else []) + s["tail"]
            keys.add(tuple(p))
            assert fresh.match(p + [5]) == len(p) > 0
        assert added == len(fresh) == len(keys)

    check()
    assert outcomes == {"loaded", "refused"}


def test_a_damaged_file_never_raises_anything_else(model, tmp_path):
    """Property: a saved file with bytes changed (often in its header), cut or extended either loads or raises
    PrefixCacheFileError naming it, adding nothing."""
    from hypothesis import given, strategies as st

    pc = cache(model)
    pc.generate([ids(BS + 3, 44)], 1)
    pc.save(tmp_path / "good.safetensors")
    good = (tmp_path / "good.safetensors").read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")
    target = tmp_path / "damaged.safetensors"
    at = st.one_of(st.integers(0, header - 1), st.integers(0, len(good) - 1))

    @given(st.lists(st.tuples(at, st.integers(0, 255)), max_size=4), st.integers(0, len(good)), st.binary(max_size=16))
    def check(edits, cut, tail):
        data = bytearray(good)
        for i, value in edits:
            data[i] = value
        target.write_bytes(bytes(data[:cut]) + tail)
        fresh = cache(model)
        try:
            fresh.load(target)
        except PrefixCacheFileError as e:
            assert str(e).startswith(f"{target}: ") and len(fresh) == 0

    check()


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pc_cli"), pattern="ME*-M", seed=5)


PROMPT = "The grass is green. The sky is blue. The sun is yellow. What color is the grass?"


def run_cli(capsys, *args):
    from hybrid import cli

    status = cli.main(["generate", *[str(a) for a in args]])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_reuses_its_file_and_creates_a_missing_directory(cli_ckpt, tmp_path, capsys):
    store = tmp_path / "new" / "sub" / "prefix.safetensors"
    args = [cli_ckpt, "--prompt", PROMPT, "--max-new-tokens", "6", "--json", "--prefix-cache", store,
            "--prefix-snapshot-interval", "16"]
    status, out, err = run_cli(capsys, *args)
    assert status == 0 and store.exists(), err
    first = json.loads(out)
    status, out, err = run_cli(capsys, *args)
    second = json.loads(out)
    n = first["prompt_tokens"]
    assert status == 0 and first["prefix_cache_reused_tokens"] == 0
    assert second["prefix_cache_reused_tokens"] == n and second["token_ids"] == first["token_ids"]  # whole, from the file
    status, out, err = run_cli(capsys, *args[:-2], "--prefix-block-size", "32")  # the old name, another interval
    assert status == 0 and json.loads(out)["token_ids"] == first["token_ids"], err


@pytest.mark.parametrize("kind", ["malformed-blocks", "block-size", "unreadable"])
def test_the_cli_notes_a_file_it_cannot_use_and_leaves_it_unchanged(cli_ckpt, tmp_path, capsys, kind):
    import hybrid

    store = tmp_path / "prefix.safetensors"
    if kind == "unreadable":
        store.write_bytes(b"\x00\x01 not a safetensors file")
        expected = "not a readable prefix-cache file"
    else:
        from safetensors import safe_open

        pc = cache(hybrid.load_model(cli_ckpt))
        pc.generate([ids(40, 45)], 1)
        pc.save(tmp_path / "good.safetensors")
        with safe_open(str(tmp_path / "good.safetensors"), "pt") as f:
            saved = (None, f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
        blocks = json.loads(saved[1]["blocks"])
        meta = {"blocks": json.dumps([blocks[0], {"parent": 0}])} if kind == "malformed-blocks" else {"block_size": "8"}
        rewrite(saved, store, meta)
        expected = r"not a list of .*\(entry 1" if kind == "malformed-blocks" else "block_size 8 differs from 16"
    before = store.read_bytes()
    status, out, err = run_cli(capsys, cli_ckpt, "--prompt", PROMPT, "--max-new-tokens", "2", "--json",
                               "--prefix-cache", store)
    assert status == 0, err
    assert "note: not using the prefix cache (left unchanged): " in err and str(store) in err
    assert re.search(expected, err), err
    assert json.loads(out)["prefix_cache_reused_tokens"] == 0 and store.read_bytes() == before


@pytest.mark.parametrize("where", ["under-a-file", "proc", "a-directory"])
def test_an_unwritable_prefix_cache_path_is_refused_before_loading_the_model(tmp_path, monkeypatch, capsys, where):
    """`--prefix-cache` under a regular file, in /proc, or naming a directory: one `error:` line naming the
    path, exit 2, before the model is loaded (so no generation is wasted)."""
    import os

    import hybrid.loading

    (tmp_path / "afile").write_text("x")
    path = {"under-a-file": tmp_path / "afile" / "pc.st", "proc": "/proc/pc.st", "a-directory": tmp_path}[where]
    if where == "proc" and not os.path.isdir("/proc"):
        pytest.skip("no /proc")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(hybrid.loading, "load", no_load)
    status, _, err = run_cli(capsys, tmp_path, "--prompt", "hi", "--prefix-cache", path)
    assert status == 2
    assert err.startswith("error: --prefix-cache: ") and err.count("\n") == 1 and str(path) in err, err


@pytest.mark.parametrize("flag,value", [("--prefix-snapshot-interval", "20"), ("--prefix-block-size", "8"),
                                        ("--prefix-snapshot-interval", "0")])
def test_a_snapshot_interval_that_is_not_a_multiple_of_the_block_size_is_refused(tmp_path, capsys, flag, value):
    from hybrid import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", str(tmp_path), "--prompt", "hi", "--prefix-cache", str(tmp_path / "pc.st"), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--prefix-snapshot-interval" in err and value in err, err
    assert not (tmp_path / "pc.st").exists()
