"""Prefix caching of the hybrid state: a hit gives the logits and greedy tokens of a cold run, for every
way a prefix can end relative to the blocks, and the cache never leaks one request's decoding into another."""

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.prefix_cache import PrefixCache, PrefixCacheFileError
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


# ---------------------------------------------------------------------------------------------- saved files
def _saved(model, path, n_blocks=2):
    cache = PrefixCache(model, block_size=BLOCK)
    cache.prefill(ids(n_blocks * BLOCK + 3, 21))
    cache.save(path)
    return path


def _damaged(path, kind):
    data = path.read_bytes()
    if kind == "cut-short":  # an interrupted copy: the header is whole, the tensor data is not
        return data[: len(data) - 100]
    if kind == "not-safetensors":
        return b"GGUF" + bytes(200)
    if kind == "empty":
        return b""
    if kind == "header-only":
        return data[:8]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["cut-short", "not-safetensors", "empty", "header-only"])
def test_an_unreadable_file_is_refused_with_a_clear_error_and_adds_nothing(model, tmp_path, kind):
    store = _saved(model, tmp_path / "prefix.safetensors")
    store.write_bytes(_damaged(store, kind))
    fresh = PrefixCache(model, block_size=BLOCK)
    with pytest.raises(PrefixCacheFileError, match=str(store)):
        fresh.load(store)
    assert len(fresh) == 0


def test_a_tensor_of_another_shape_or_a_bad_node_list_is_refused(model, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    store = _saved(model, tmp_path / "prefix.safetensors")
    with safe_open(str(store), "pt") as f:
        meta = f.metadata()
    tensors = load_file(store)
    for name, meta_change, match in [("1.mamba.0.ssm", {}, r"1\.mamba\.0\.ssm is"),
                                     (None, {"nodes": "[{"}, "not JSON"),
                                     (None, {"nodes": '[{"digest": 3}]'}, "not a list of")]:
        bad = dict(tensors)
        if name is not None:
            bad[name] = bad[name][..., :-1].contiguous()
        save_file(bad, tmp_path / "bad.safetensors", metadata={**meta, **meta_change})
        fresh = PrefixCache(model, block_size=BLOCK)
        with pytest.raises(PrefixCacheFileError, match=match):
            fresh.load(tmp_path / "bad.safetensors")
        assert len(fresh) == 0  # nothing half-loads: the first node was fine


def _with_nodes(model, tmp_path, nodes, n_blocks=2):
    """A saved file (n_blocks nodes) with its node list replaced by `nodes` (a function of the real entries)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    store = _saved(model, tmp_path / "prefix.safetensors", n_blocks=n_blocks)
    with safe_open(str(store), "pt") as f:
        meta = f.metadata()
    entries = json.loads(meta["nodes"])
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(store), bad, metadata={**meta, "nodes": json.dumps(nodes(entries))})
    return bad


@pytest.mark.parametrize("kind,nodes,match", [
    ("no-parent", lambda e: [{"digest": e[0]["digest"]}, e[1]], r"not a list of .*entry 0"),
    ("no-parent-later", lambda e: [e[0], {"digest": e[1]["digest"]}], r"not a list of .*entry 1"),
    ("duplicated-digest", lambda e: [e[0], {"digest": e[0]["digest"], "parent": None}], r"twice \(entry 1\)"),
    ("own-parent", lambda e: [{"digest": e[0]["digest"], "parent": e[0]["digest"]}, e[1]], r"its own parent \(entry 0"),
    ("parent-later", lambda e: [e[1], e[0]], r"not an earlier entry \(entry 0"),
    ("cycle", lambda e: [{"digest": e[0]["digest"], "parent": e[1]["digest"]},
                         {"digest": e[1]["digest"], "parent": e[0]["digest"]}], r"not an earlier entry \(entry 0"),
    ("unknown-parent", lambda e: [e[0], {"digest": e[1]["digest"], "parent": "f" * 64}], r"not an earlier entry \(entry 1"),
    ("not-an-object", lambda e: [e[0], [1, 2]], r"not a list of .*entry 1"),
])
def test_a_malformed_node_list_is_refused_naming_the_file_and_entry(model, tmp_path, kind, nodes, match):
    """Every malformed tree (a missing key, a duplicate, a self-parent, a parent not earlier, a cycle) raises
    PrefixCacheFileError naming the file and the entry, and adds nothing."""
    bad = _with_nodes(model, tmp_path, nodes)
    fresh = PrefixCache(model, block_size=BLOCK)
    with pytest.raises(PrefixCacheFileError, match=match) as e:
        fresh.load(bad)
    assert str(bad) in str(e.value)
    assert len(fresh) == 0


def test_any_node_list_either_loads_or_is_refused(model, tmp_path):
    """Property: any node list made of the file's digests, unknown ones and missing keys (in any order, with
    repeats) loads a tree or raises PrefixCacheFileError, adding nothing then."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    store = _saved(model, tmp_path / "prefix.safetensors", n_blocks=3)
    with safe_open(str(store), "pt") as f:
        meta = f.metadata()
    tensors, real = load_file(store), [e["digest"] for e in json.loads(meta["nodes"])]
    target = tmp_path / "edited.safetensors"
    digest = st.sampled_from(real + ["0" * 64])
    entry = st.fixed_dictionaries({"digest": digest}, optional={"parent": st.one_of(st.none(), digest)})

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(entry, max_size=4))
    def check(entries):
        save_file(tensors, target, metadata={**meta, "nodes": json.dumps(entries)})
        fresh = PrefixCache(model, block_size=BLOCK)
        try:
            added = fresh.load(target)
        except PrefixCacheFileError:
            assert len(fresh) == 0
            return
        assert added == len(entries) == len({e["digest"] for e in entries})
        for i, e in enumerate(entries):
            assert e["parent"] is None or e["parent"] in [x["digest"] for x in entries[:i]]

    check()


def test_the_cli_notes_a_malformed_node_list_and_leaves_the_file_unchanged(tmp_path):
    import subprocess
    import sys

    from tiny_checkpoint import write_checkpoint

    import hybrid

    ckpt = write_checkpoint(tmp_path / "ck", pattern="ME*-M", seed=5)
    model = hybrid.load_model(ckpt)
    bad = _with_nodes(model, tmp_path, lambda e: [{"digest": e[0]["digest"]}, e[1]])
    before = bad.read_bytes()
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "generate", str(ckpt), "--prompt", "The grass is green.",
                        "--max-new-tokens", "2", "--prefix-cache", str(bad), "--prefix-block-size", str(BLOCK)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "note: not using the prefix cache (left unchanged)" in r.stderr and "Traceback" not in r.stderr
    assert str(bad) in r.stderr and "entry 0" in r.stderr
    assert bad.read_bytes() == before


def test_a_damaged_file_never_raises_anything_else(model, tmp_path):
    """Property: any byte string (a saved file with bytes changed, cut or extended) either loads or raises
    PrefixCacheFileError."""
    from hypothesis import given, strategies as st

    good = _saved(model, tmp_path / "good.safetensors", n_blocks=1).read_bytes()
    target = tmp_path / "damaged.safetensors"

    @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=4),
           st.integers(0, len(good)), st.binary(max_size=16))
    def check(edits, cut, tail):
        data = bytearray(good)
        for at, value in edits:
            data[at] = value
        target.write_bytes(bytes(data[:cut]) + tail)
        try:
            PrefixCache(model, block_size=BLOCK).load(target)
        except PrefixCacheFileError:
            pass

    check()


def test_a_failed_save_leaves_the_previous_file(model, tmp_path, monkeypatch):
    import safetensors.torch

    store = _saved(model, tmp_path / "prefix.safetensors")
    before = store.read_bytes()

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _saved(model, store, n_blocks=3)
    assert store.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["prefix.safetensors"]


def test_one_changed_weight_element_in_an_expert_bank_makes_the_old_file_stale(tmp_path):
    """The file of a model whose expert bank then changes by one element in the middle of one expert (far
    from any sampled window a partial digest would read) is refused; the model's own file still loads."""
    import hybrid

    source = tmp_path / "model"
    hybrid.save_checkpoint(random_model("M*E", seed=5, hidden_size=64, moe_intermediate_size=512,
                                        n_routed_experts=4), source)
    model = hybrid.load_model(source)
    store = _saved(model, tmp_path / "prefix.safetensors")
    with torch.no_grad():  # expert 2's up_proj [512, 64] fp32 is 128 KiB: element (100, 10) at byte 25,640
        model.backbone.layers[2].mixer.experts.up_proj[2, 100, 10] += 2 ** -20
    hybrid.save_checkpoint(model, tmp_path / "changed")
    with pytest.raises(PrefixCacheFileError, match="another model"):
        PrefixCache(hybrid.load_model(tmp_path / "changed"), block_size=BLOCK).load(store)
    assert PrefixCache(hybrid.load_model(source), block_size=BLOCK).load(store) == 2


def test_the_cli_notes_an_unreadable_file_and_leaves_it_unchanged(tmp_path):
    import subprocess
    import sys

    from tiny_checkpoint import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ck", pattern="ME*-M", seed=5)
    store = tmp_path / "prefix.safetensors"
    store.write_bytes(b"\x00\x01 not a safetensors file")
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "generate", str(ckpt), "--prompt", "The grass is green.",
                        "--max-new-tokens", "2", "--prefix-cache", str(store)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "note: not using the prefix cache (left unchanged)" in r.stderr and "Traceback" not in r.stderr
    assert store.read_bytes() == b"\x00\x01 not a safetensors file"


@pytest.mark.parametrize("where", ["under-a-file", "proc", "a-directory"])
def test_an_unwritable_prefix_cache_path_is_refused_before_loading_the_model(tmp_path, monkeypatch, capsys, where):
    """`--prefix-cache` under a regular file, in /proc, or naming a directory: one `error:` line naming the
    path, exit 2, before the model is loaded (so no generation is wasted)."""
    import os

    import hybrid.loading
    from hybrid import cli

    (tmp_path / "afile").write_text("x")
    path = {"under-a-file": tmp_path / "afile" / "pc.st", "proc": "/proc/pc.st", "a-directory": tmp_path}[where]
    if where == "proc" and not os.path.isdir("/proc"):
        pytest.skip("no /proc")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(hybrid.loading, "load", no_load)
    assert cli.main(["generate", str(tmp_path), "--prompt", "hi", "--prefix-cache", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prefix-cache: ") and err.count("\n") == 1 and str(path) in err, err
    assert "Traceback" not in err


def test_a_missing_prefix_cache_directory_is_created(tmp_path):
    from hybrid.atomic import check_writable

    assert check_writable(tmp_path / "new" / "sub" / "pc.st") == (tmp_path / "new" / "sub" / "pc.st").resolve()
    assert (tmp_path / "new" / "sub").is_dir() and list((tmp_path / "new" / "sub").iterdir()) == []
