"""The serving engine (`hybrid.serving`): continuous batching over paged KV blocks and Mamba state slots.

Oracle: `hybrid.generate.generate_ids` on the request alone (itself tested against transformers), on tiny
fp32 checkpoints saved by transformers. Every test runs requests together on the engine and asserts each
one's tokens equal its solo run, whatever the chunking, the arrival order, the block layout, preemption or
a prefix hit.
"""

from __future__ import annotations

import re

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams
from hybrid.serving.engine import Engine
from hybrid.serving.request import Status


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("nano_like_c16").ours


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]


def alone(model, prompt, max_tokens, sampling=None, stop_ids=()):
    return generate_ids(model, [prompt], max_new_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids)[0].token_ids


def run_staggered(engine: Engine, requests: list[tuple[list[int], int]], every: int, sampling=None, seen=None):
    """Add one request every `every` steps (interleaving admissions with decoding and frees); run to the end.
    Returns each request's tokens. `seen(engine)` is called after every step."""
    pending = list(enumerate(requests))
    ids: dict[str, int] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, (prompt, max_tokens) = pending.pop(0)
            s = sampling[i] if isinstance(sampling, list) else sampling
            ids[engine.add_request(prompt, s, max_tokens)] = i
        engine.step()
        if seen is not None:
            seen(engine)
        step += 1
    out = [None] * len(requests)
    for rid, i in ids.items():
        out[i] = engine.requests[rid].output_ids
    return out


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", ["nano_like_c16", "all4_ng2_gqa4_c8", "ngnh_mqa_c8_k2"])
def test_a_request_among_15_others_gives_its_tokens_alone(checkpoint, name):
    model = checkpoint(name).ours
    prompts = random_prompts(16, 1, 40, seed=1)
    max_tokens = [4 + (3 * i) % 13 for i in range(16)]
    expected = [alone(model, p, m) for p, m in zip(prompts, max_tokens)]
    engine = Engine(model, num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=24)
    got = engine.generate(prompts, max_tokens=20)  # all at once: chunked prefills packed with decodes
    assert [c.token_ids[:m] for c, m in zip(got, max_tokens)] == expected
    staggered = run_staggered(Engine(model, num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=24),
                              list(zip(prompts, max_tokens)), every=2)
    assert staggered == expected


def test_decode_steps_padded_to_buckets_give_the_unpadded_tokens(model):
    """decode_buckets (the fixed shapes of CUDA graphs): a decode step of n sequences runs n real rows and
    padding rows up to the smallest bucket that holds n; every request's tokens, greedy and seeded-sampled
    (penalized too), equal those of the unpadded engine, as requests arrive, finish and run mixed steps."""
    prompts = random_prompts(7, 1, 30, seed=40)
    requests = list(zip(prompts, [3 + (5 * i) % 11 for i in range(7)]))
    sampling = [SamplingParams(temperature=0.9, seed=i, top_p=0.9, repetition_penalty=1.1 if i % 3 == 0 else 1.0)
                if i % 2 else SamplingParams() for i in range(7)]
    sizes = []

    def seen(engine):
        sizes.append((engine.last_step.num_seqs, engine.cache.packed.lengths))

    def serve(**kwargs):
        engine = Engine(model, num_blocks=96, block_size=4, max_num_seqs=7, max_num_batched_tokens=24, **kwargs)
        return run_staggered(engine, requests, every=2, sampling=sampling, seen=seen)

    plain = serve()
    sizes.clear()
    padded = serve(decode_buckets=(1, 2, 4, 8))
    assert padded == plain
    decodes = [(n, lengths) for n, lengths in sizes if set(lengths) == {1}]
    assert {len(lengths) for _, lengths in decodes} <= {1, 2, 4, 8}  # each decode step ran a bucket's rows
    assert any(len(lengths) > n for n, lengths in decodes)  # with padding rows beside the real ones
    assert all(len(lengths) == n for n, lengths in sizes if set(lengths) != {1})  # mixed steps: no padding
    with pytest.raises(ValueError, match="a decode bucket must be an integer >= 1"):
        Engine(model, num_blocks=8, decode_buckets=(4, 0))


@pytest.mark.parametrize("budget", [1, 3, 7, 16, 64])
def test_however_the_prompt_is_chunked(model, budget):
    prompt = random_prompts(1, 50, 50, seed=2)[0]
    engine = Engine(model, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=budget)
    assert engine.generate([prompt], max_tokens=12)[0].token_ids == alone(model, prompt, 12)


def test_decode_tokens_never_leave_a_prompt_a_sliver_to_its_snapshot_position(model):
    """3 sequences decode while a 70-token prompt prefills with a budget of 16 and snapshots every 16: each of its
    chunks runs to the next multiple of 16 (or the prompt's end) in one step, up to 3 tokens over the budget,
    where cutting at the budget left a 3-token step per chunk; every request's tokens are its own alone."""
    short = random_prompts(3, 5, 9, seed=30)
    long = random_prompts(1, 70, 70, seed=31)[0]
    engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                    prefix_caching=True, snapshot_interval=16)
    ids = [engine.add_request(p, None, 40) for p in short]
    while any(not engine.requests[i].output_ids for i in ids):
        engine.step()
    rid = engine.add_request(long, None, 6)
    ends, steps = [], []
    while engine.requests[rid].num_computed < len(long):
        engine.step()
        ends.append(engine.requests[rid].num_computed)
        steps.append(engine.last_step.num_tokens)
    assert ends == [16, 32, 48, 64, 70]
    assert max(steps) == 16 + 3 and all(s <= 16 + 3 for s in steps)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[rid].output_ids == alone(model, long, 6)
    assert [engine.requests[i].output_ids for i in ids] == [alone(model, p, 40) for p in short]


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_among_others(model):
    prompts = random_prompts(8, 2, 30, seed=3)
    params = [SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=100 + i) for i in range(8)]
    expected = [alone(model, p, 16, sampling=s) for p, s in zip(prompts, params)]
    assert len({tuple(e) for e in expected}) == 8  # the draws really differ
    engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    assert run_staggered(engine, [(p, 16) for p in prompts], every=3, sampling=params) == expected
    # the same objects give the same tokens again (each request starts from its seed)
    engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    assert [c.token_ids for c in engine.generate(prompts, params, max_tokens=16)] == expected


def test_stop_ids_and_max_tokens_end_a_request_as_generate_does(model):
    prompts = random_prompts(6, 3, 20, seed=4)
    free_run = [alone(model, p, 12) for p in prompts]
    stop = {next(t for t in free_run[0][2:] if t not in free_run[1])}  # row 0 stops, row 1 runs to the limit
    expected = [generate_ids(model, [p], 12, stop_ids=sorted(stop))[0] for p in prompts]
    got = Engine(model, num_blocks=64, block_size=8).generate(prompts, max_tokens=12, stop_ids=stop)
    assert [(c.token_ids, c.finish_reason) for c in got] == [(e.token_ids, e.finish_reason) for e in expected]
    assert {c.finish_reason for c in got} == {"stop", "length"}


# ---------------------------------------------------------------------------------------------- logprobs
def test_logprobs_are_the_models_log_softmax_and_only_for_the_requests_that_ask(model):
    """Oracle: float64 log_softmax of the model's own logits over prompt + output in one forward alone (the
    raw distribution, whatever the temperature); the top k in order; asking changes no token."""
    prompts = random_prompts(4, 2, 30, seed=11)
    ks = [None, 0, 3, 5]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, logprobs=k) for i, k in enumerate(ks)]
    engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    ids = [engine.add_request(p, s, 6) for p, s in zip(prompts, params)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    for rid, prompt, k, s in zip(ids, prompts, ks, params):
        tokens = [t for out in got[rid] for t in out.new_token_ids]
        assert tokens == alone(model, prompt, 6, sampling=s)
        if k is None:
            assert all(out.logprobs is None for out in got[rid])
            continue
        with torch.inference_mode():
            oracle = model(torch.tensor([prompt + tokens]))[0].double().log_softmax(-1)[len(prompt) - 1:-1]
        for position, (token, out) in enumerate(zip(tokens, got[rid])):
            (lp,) = out.logprobs
            top = oracle[position].topk(k)
            assert lp.logprob == pytest.approx(oracle[position, token].item(), abs=1e-5)
            assert lp.top_ids == top.indices.tolist()
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_logprobs_must_be_an_integer_of_at_least_0(bad):
    with pytest.raises(ValueError, match=re.escape(f"logprobs must be an integer >= 0 or None, got {bad!r}")):
        SamplingParams(logprobs=bad)


# ---------------------------------------------------------------------------------------------- packing
def test_tokens_of_all_sequences_are_packed_without_padding(model):
    """Every forward is one row of exactly the scheduled tokens, and over a run each position of each
    request is fed exactly once: prompt + output - 1 (the last token is never fed): 0 padded positions."""
    prompts = random_prompts(12, 1, 30, seed=5)
    fed = []
    hook = model.backbone.embeddings.register_forward_hook(lambda m, args, out: fed.append(tuple(args[0].shape)))
    try:
        engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=12, max_num_batched_tokens=20)
        rows = []
        outs = run_staggered(engine, [(p, 7) for p in prompts], every=1,
                             seen=lambda e: rows.append((e.last_step.num_seqs, e.last_step.num_tokens)))
    finally:
        hook.remove()
    assert all(b == 1 for b, _ in fed)
    assert [t for _, t in fed] == [t for s, t in rows if s]
    assert any(s > 1 for s, _ in rows)  # sequences really shared forwards
    real = sum(len(p) + len(o) - 1 for p, o in zip(prompts, outs))
    padded = sum(t for _, t in fed) - real
    assert padded == 0


def test_blocks_end_up_scattered_and_outputs_still_equal_solo_runs(model):
    prompts = random_prompts(10, 5, 30, seed=6)
    max_tokens = [3 + (7 * i) % 11 for i in range(10)]
    expected = [alone(model, p, m) for p, m in zip(prompts, max_tokens)]
    scattered = []

    def seen(engine):
        for r in engine.scheduler.running:
            t = r.block_table
            if len(t) > 1 and any(b != a + 1 for a, b in zip(t, t[1:])):
                scattered.append(r.request_id)

    engine = Engine(model, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    assert run_staggered(engine, list(zip(prompts, max_tokens)), every=2, seen=seen) == expected
    assert scattered, "no request held non-contiguous blocks: the test did not exercise paging"


# ---------------------------------------------------------------------------------------------- pools
def test_pools_are_allocated_once_and_everything_is_freed(model):
    engine = Engine(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    pointers = [t.data_ptr() for t in engine.blocks.k + engine.blocks.v + engine.slots.conv + engine.slots.ssm]
    nbytes = engine.blocks.nbytes() + engine.slots.nbytes()
    for seed in range(3):
        engine.generate(random_prompts(6, 2, 25, seed=10 + seed), max_tokens=6)
    assert [t.data_ptr() for t in engine.blocks.k + engine.blocks.v + engine.slots.conv + engine.slots.ssm] == pointers
    assert engine.blocks.nbytes() + engine.slots.nbytes() == nbytes
    assert engine.blocks.num_free == 64 and engine.slots.num_free == 4 and not engine.requests


@pytest.mark.parametrize("kernel", [True, False], ids=["prompt-chunk-kernel", "pytorch"])
@pytest.mark.parametrize("lengths", [[5, 1, 9, 7, 1, 30], [3, 3], [2, 40, 1]])
def test_prompt_chunks_of_several_sequences_run_batched_as_each_alone(model, lengths, kernel, monkeypatch):
    """A packed Mamba forward of decode tokens and prompt chunks of different lengths (all chunks in one call
    of the C++ prompt-chunk kernel on their slot rows; without it, chunks of close lengths as one right-padded
    batch on states gathered from their slots) gives every sequence the output and the final conv window
    and SSM state of the same tokens run alone from its own state; the other slots are untouched. Oracle:
    each sequence alone through the mixer on a copy of its state, in PyTorch (the kernel off)."""
    import hybrid.ops as ops
    from helpers import run_mixer
    from hybrid.cache import MambaState
    from hybrid.serving.blocks import BlockPool
    from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
    from hybrid.serving.slots import StateSlots

    config = model.config
    layer = config.hybrid_override_pattern.index("M")
    mixer = model.backbone.layers[layer].mixer
    g = torch.Generator().manual_seed(len(lengths))
    slots = StateSlots(config, len(lengths) + 2, torch.float32)
    for conv, ssm in zip(slots.conv, slots.ssm):
        conv.copy_(torch.randn(conv.shape, generator=g))
        ssm.copy_(torch.randn(ssm.shape, generator=g))
    before = [(c.clone(), s.clone()) for c, s in zip(slots.conv, slots.ssm)]
    cache = PagedCache(config, BlockPool(config, 64, 4, torch.float32), slots)
    slot_of = [len(lengths) + 1 - i for i in range(len(lengths))]  # slots in another order than the rows
    cache.schedule([ScheduledSeq(list(range(16)), slot, 3, n) for slot, n in zip(slot_of, lengths)])
    x = torch.randn(1, sum(lengths), config.hidden_size, generator=g)
    pytorch_prefill = lambda *args: None  # noqa: E731
    if not kernel:
        monkeypatch.setattr(ops, "mamba_chunks_fused", pytorch_prefill)
    with torch.inference_mode():
        got = mixer(x, cache.begin(1, sum(lengths), None), cache.layer(layer))
        monkeypatch.setattr(ops, "mamba_chunks_fused", pytorch_prefill)
        start = 0
        for slot, n in zip(slot_of, lengths):
            state = MambaState(conv=before[0][0][slot:slot + 1].clone(), ssm=before[0][1][slot:slot + 1].clone())
            want = run_mixer(mixer, x[:, start:start + n], state, past=3)
            torch.testing.assert_close(got[:, start:start + n], want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(slots.conv[0][slot], state.conv[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(slots.ssm[0][slot], state.ssm[0], rtol=1e-5, atol=1e-5)
            start += n
    for other in set(range(slots.num_slots)) - set(slot_of):
        assert torch.equal(slots.conv[0][other], before[0][0][other]) and torch.equal(slots.ssm[0][other], before[0][1][other])


def test_pad_groups_batches_close_lengths_and_leaves_long_chunks_alone():
    from hybrid.ops.prefill import pad_groups

    segs = [(0, 0, 26), (1, 26, 52), (2, 52, 452), (3, 452, 480), (4, 480, 500)]
    groups = pad_groups(segs)
    assert sorted(s for g in groups for s, _, _ in g) == [0, 1, 2, 3, 4]
    assert [sorted(s for s, _, _ in g) for g in groups] == [[0, 1, 3, 4], [2]]
    for group in groups:  # the padded size of a group is within twice its real tokens
        longest = max(e - b for _, b, e in group)
        assert len(group) * longest <= 2 * sum(e - b for _, b, e in group)


def test_preemption_recomputes_the_youngest_and_changes_no_token(model):
    """A pool too small for every request at once: the youngest running request is preempted (blocks and
    slot freed), recomputed later, and every request still gives its solo tokens, greedy and seeded."""
    prompts = random_prompts(6, 10, 20, seed=8)
    params = [None, SamplingParams(temperature=1.0, seed=5)] * 3
    expected = [alone(model, p, 24, sampling=s) for p, s in zip(prompts, params)]
    engine = Engine(model, num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    preempted_when_youngest = []

    def seen(e):
        running = [r.arrival for r in e.scheduler.running]
        for r in e.scheduler.waiting:
            if r.num_preemptions and running:
                preempted_when_youngest.append(r.arrival > min(running))

    ids = [engine.add_request(p, s, 24) for p, s in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        seen(engine)
    assert engine.scheduler.num_preemptions > 0
    assert preempted_when_youngest and all(preempted_when_youngest)  # never the oldest running one
    assert [engine.requests[i].output_ids for i in ids] == expected
    assert engine.blocks.num_free == 24


def test_abort_frees_blocks_and_slot_at_once_and_leaves_the_others_unchanged(model):
    prompts = random_prompts(3, 8, 16, seed=9)
    engine = Engine(model, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    ids = [engine.add_request(p, None, 10) for p in prompts]
    for _ in range(3):
        engine.step()
    held = len(engine.requests[ids[1]].block_table)
    free_before = engine.blocks.num_free
    engine.abort(ids[1])
    assert engine.blocks.num_free == free_before + held and engine.slots.num_free == 1
    assert engine.requests[ids[1]].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    for i in (0, 2):
        assert engine.requests[ids[i]].output_ids == alone(model, prompts[i], 10)
    engine.abort("no such request")  # ignored


def test_max_model_len_ends_a_request_with_length(model):
    prompt = random_prompts(1, 10, 10, seed=11)[0]
    engine = Engine(model, num_blocks=16, block_size=4, max_model_len=16)
    (c,) = engine.generate([prompt], max_tokens=100)
    assert (c.token_ids, c.finish_reason) == (alone(model, prompt, 6), "length")


# ---------------------------------------------------------------------------------------------- prefix caching
def test_64_requests_sharing_a_2k_prefix_hold_its_kv_once(model):
    """The prefix's 128 blocks are held once, by all 64 requests (reference count 64), and a request resumed
    from the snapshot gives its cold tokens."""
    shared = random_prompts(1, 2048, 2048, seed=12)[0]
    tails = random_prompts(64, 1, 6, seed=13)
    engine = Engine(model, num_blocks=512, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    prefix_caching=True, snapshot_interval=512)
    first = engine.add_request(shared + tails[0], None, 4)
    while engine.requests[first].status is not Status.FINISHED:
        engine.step()
    ids = [first] + [engine.add_request(shared + t, None, 4) for t in tails[1:]]
    engine.step()  # admits all 63: each resumes at 2048 and computes only its tail
    running = engine.scheduler.running
    assert len(running) == 63 and all(r.num_cached_tokens == 2048 for r in running)
    prefix_blocks = running[0].block_table[:128]
    assert all(r.block_table[:128] == prefix_blocks for r in running)
    assert all(engine.blocks.refcount[b] == 63 for b in prefix_blocks)
    used = engine.blocks.num_blocks - engine.blocks.num_free
    assert used == 128 + 63  # the prefix once, then one block of its own per request
    while engine.has_unfinished():
        engine.step()
    for i in (0, 1, 37):
        assert engine.requests[ids[i]].output_ids == alone(model, shared + tails[i], 4)


def test_a_prefix_hit_gives_the_cold_tokens_however_it_was_chunked(model):
    shared = random_prompts(1, 45, 45, seed=14)[0]
    followers = [shared + t for t in random_prompts(5, 1, 9, seed=15)]
    expected = [alone(model, p, 8) for p in followers]
    for budget in (5, 16, 64):
        engine = Engine(model, num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
                        prefix_caching=True, snapshot_interval=8)
        engine.generate([shared + [7]], max_tokens=2)
        got = engine.generate(followers, max_tokens=8)
        assert [c.token_ids for c in got] == expected
        assert [c.cached_tokens for c in got] == [40] * 5  # the last snapshot before the shared prefix ends


def test_the_next_turn_resumes_at_the_previous_prompts_end(model):
    turn1 = random_prompts(1, 37, 37, seed=16)[0]
    engine = Engine(model, num_blocks=128, block_size=4, prefix_caching=True, snapshot_interval=16)
    (reply,) = engine.generate([turn1], max_tokens=6)
    turn2 = turn1 + reply.token_ids[:3] + [9, 10, 11]  # a template that re-renders the reply differently
    (c,) = engine.generate([turn2], max_tokens=8)
    assert c.cached_tokens == len(turn1)
    assert c.token_ids == alone(model, turn2, 8)


def test_a_prefix_hit_survives_preemption(model):
    shared = random_prompts(1, 24, 24, seed=17)[0]
    prompts = [shared + t for t in random_prompts(5, 2, 6, seed=18)]
    expected = [alone(model, p, 20) for p in prompts]
    engine = Engine(model, num_blocks=30, block_size=4, max_num_seqs=5, max_num_batched_tokens=64,
                    prefix_caching=True, snapshot_interval=8)
    engine.generate(prompts[:1], max_tokens=1)
    got = engine.generate(prompts, max_tokens=20)
    assert engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == expected


def test_snapshots_stay_within_their_byte_budget_least_recently_used_out(model):
    engine = Engine(model, num_blocks=256, block_size=4, prefix_caching=True, snapshot_interval=8)
    one = engine.slots.slot_nbytes()
    engine = Engine(model, num_blocks=256, block_size=4, prefix_caching=True, snapshot_interval=8,
                    prefix_cache_bytes=3 * one + 1000)
    a, b = random_prompts(2, 33, 33, seed=19)
    engine.generate([a], max_tokens=1)  # snapshots at 8, 16, 24, 32, 33: only the last three kept
    assert engine.prefix.nbytes <= 3 * one + 1000 and len(engine.prefix.snapshots) == 3
    assert engine.prefix.match(a + [5]) == 33 and engine.prefix.match(a[:20] + [5]) == 0
    engine.generate([b], max_tokens=1)
    assert engine.prefix.match(a + [5]) == 0 and engine.prefix.match(b + [5]) == 33


def test_a_dropped_snapshots_states_are_written_again_by_the_next_and_hits_stay_exact(model):
    """Past the byte budget each new snapshot's Mamba states go into the storage of one the budget dropped (no
    fresh pages a request), and a hit on it gives the cold run's tokens."""
    one = Engine(model, num_blocks=256, block_size=4).slots.slot_nbytes()
    engine = Engine(model, num_blocks=256, block_size=4, prefix_caching=True, snapshot_interval=64,
                    prefix_cache_bytes=2 * one + 1000)
    prompts = random_prompts(4, 20, 30, seed=20)
    storage = lambda snapshot: {t.data_ptr() for pair in snapshot.mamba for t in pair}
    seen = set()
    for i, p in enumerate(prompts):
        engine.generate([p], max_tokens=1)  # one snapshot each, at the prompt's end
        last = list(engine.prefix.snapshots.values())[-1]  # the most recently used
        assert last.length == len(p)
        if i >= 3:  # the first two fill the budget, the third drops the first
            assert storage(last) <= seen
        seen |= storage(last)
    assert len(engine.prefix.snapshots) == 2
    turn2 = prompts[-1] + [7, 8, 9]
    (c,) = engine.generate([turn2], max_tokens=6)
    assert c.cached_tokens == len(prompts[-1]) and c.token_ids == alone(model, turn2, 6)


# ---------------------------------------------------------------------------------------------- errors
def test_bad_requests_and_sizes_are_clear_errors(model):
    engine = Engine(model, num_blocks=8, block_size=4)
    for args, match in [(([1, 96],), r"token id 96 \(prompt_ids\[1\]\) is outside"), (([],), "non-empty"),
                        (([1, 2.0],), r"prompt_ids\[1\] must be a Python int"),
                        ((list(range(3, 35)),), "prompt_ids has 32 tokens; this engine's max_model_len is 32"),
                        (([5], None, 0), "max_tokens must be an integer >= 1"),
                        (([5], 0.5), "sampling must be a SamplingParams"),
                        (([5], None, 4, 2), "stop_ids must be a list of int token ids"),
                        (([5], None, 4, ["a"]), "stop_ids must be a list of int token ids")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args)
    assert not engine.requests and not engine.has_unfinished() and engine.blocks.num_free == 8
    engine.add_request([5], None, 2, request_id="1")
    assert engine.add_request([6], None, 2) == "0" and engine.add_request([6], None, 2) == "2"  # auto ids skip "1"
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([6], None, 2, request_id="1")
    with pytest.raises(ValueError, match="has not finished"):
        engine.release("1")
    with pytest.raises(ValueError, match="has not finished"):
        engine.completion("1")
    with pytest.raises(ValueError, match="unknown request id"):
        engine.completion("nope")
    for kwargs, match in [(dict(max_model_len=33), "max_model_len"), (dict(num_blocks=0), "num_blocks must be"),
                          (dict(max_num_seqs=0), "max_num_seqs must be"), (dict(num_blocks=2.5), "num_blocks must be"),
                          (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be"),
                          (dict(max_model_len=5.5), "max_model_len must be"),
                          (dict(prefix_caching=True, snapshot_interval=6), "multiple of the block size")]:
        with pytest.raises(ValueError, match=match):
            Engine(model, **{"num_blocks": 8, "block_size": 4, **kwargs})
    with pytest.raises(ValueError, match="num_seqs must be"):
        engine.reserve(-3)


def test_a_refused_batch_queues_none_of_its_prompts(model):
    engine = Engine(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\] has 40 tokens"):
        engine.generate([[5, 6, 7], [3] * 40])
    with pytest.raises(ValueError, match=r"token id 99 \(prompts\[1\]\[0\]\)"):
        engine.generate([[5, 6, 7], [99]])
    assert not engine.requests and not engine.has_unfinished()


def test_an_abort_is_reported_by_the_next_step(model):
    engine = Engine(model, num_blocks=32, block_size=4)
    a, b = engine.add_request([5, 6, 7], None, 8), engine.add_request([8, 9], None, 8)
    engine.step()
    engine.abort(a)
    outs = engine.step()
    assert outs[0].request_id == a and outs[0].finished and outs[0].finish_reason == "abort"
    assert [o.request_id for o in outs[1:]] == [b]
    assert engine.completion(a).finish_reason == "abort"


def test_a_saved_prefix_cache_serves_a_fresh_engine(model, tmp_path):
    shared = random_prompts(1, 30, 30, seed=20)[0]
    engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=8)
    engine.generate([shared + [4]], max_tokens=2)
    engine.save_prefix_cache(tmp_path / "p.safetensors")
    fresh = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=8)
    assert fresh.load_prefix_cache(tmp_path / "p.safetensors") == len(engine.prefix.snapshots)
    (c,) = fresh.generate([shared + [4, 5, 6]], max_tokens=6)
    assert c.cached_tokens == 31 and c.token_ids == alone(model, shared + [4, 5, 6], 6)
    with pytest.raises(ValueError, match="without prefix_caching"):
        Engine(model, num_blocks=8).save_prefix_cache(tmp_path / "q.safetensors")


def test_a_server_pool_keeps_its_size_and_a_growing_pool_doubles_keeping_its_blocks():
    from hybrid.config import HybridConfig
    from hybrid.serving.blocks import BlockPool, GrowingBlockPool

    config = HybridConfig(hybrid_override_pattern="M*", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                          vocab_size=64)
    fixed = BlockPool(config, 4, 2, torch.float32)
    fixed.make_room(10)
    assert fixed.num_blocks == 4 and not fixed.grows
    pool = GrowingBlockPool(config, 4, 2, torch.float32)
    held = [pool.allocate() for _ in range(3)]
    pool.k[0][held[0]] = 1.5
    pool.make_room(1)  # one is free: nothing to do
    assert pool.num_blocks == 4
    pool.make_room(2)  # one short: at least double
    assert pool.num_blocks == 8 and pool.num_free == 5 and pool.k[0].shape[0] == 8
    assert torch.all(pool.k[0][held[0]] == 1.5) and pool.refcount[:3] == [1, 1, 1]
    pool.make_room(4, keep=4)  # four more beside four kept free: 8 free needed, 5 there
    assert pool.num_blocks == 16 and pool.num_free == 13
