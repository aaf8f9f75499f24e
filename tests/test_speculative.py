"""Speculative decoding with the MTP block inside the engine (`hybrid.serving.speculation`): greedy output equal to
plain decoding whatever the drafts, exact rollback of the hybrid state, the target distribution under sampling,
and the MTP block on the paged pool equal to the uncached block."""

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams
from hybrid.serving.blocks import BlockPool
from hybrid.serving.engine import Engine
from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
from hybrid.serving.slots import StateSlots
from hybrid.serving.speculation import SpeculativeStats
from tiny_checkpoint import random_model

V = 320


def make_model(vocab_size=V, seed=0, scale=0.3):
    return random_model("M*EM-", seed, scale, vocab_size=vocab_size, num_nextn_predict_layers=1, mtp_pattern="*E")


@pytest.fixture(scope="module")
def model():
    return make_model()


PROMPT = [5, 17, 3, 99, 250, 7, 42, 11, 64, 128, 33]
PROMPTS = [PROMPT, [9, 8, 7], list(range(40, 70))]


class OracleDrafter:
    """Drafts the plain greedy continuation (`truth`): right for the first `right` drafts of each round, wrong
    after them, so every acceptance count from none to all is exercised."""

    def __init__(self, truth: dict[tuple, list[int]], num_speculative_tokens: int, right: int):
        self.truth, self.num_speculative_tokens, self.right = truth, num_speculative_tokens, right
        self.stats = SpeculativeStats()

    def drafts(self, request) -> bool:
        return True

    def propose(self, computed, budget, reserve) -> None:
        for c in computed:
            r = c.request
            full, at = self.truth[tuple(r.prompt_ids)], r.num_tokens
            r.draft_ids = [full[at + i] if i < self.right else (full[at + i] + 1) % V
                           for i in range(min(budget(r), len(full) - at))]


def oracle_engine(model, plain, n, right, **kwargs) -> Engine:
    engine = Engine(model, num_speculative_tokens=n, **kwargs)
    engine.drafter = OracleDrafter({tuple(p): p + c.token_ids for p, c in zip(PROMPTS, plain)}, n, right)
    return engine


@pytest.mark.parametrize("num_draft", [1, 2, 3, 5])
def test_greedy_equals_plain_greedy_with_mtp_drafts(model, num_draft):
    """Random MTP weights: most drafts are rejected, every round rolls back; three prompts at once."""
    plain = generate_ids(model, PROMPTS, max_new_tokens=24)
    spec = generate_ids(model, PROMPTS, max_new_tokens=24, speculative=num_draft)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(c.acceptance_rate is not None and c.acceptance_rate < 1 for c in spec)
    assert plain[0].acceptance_rate is None


@pytest.mark.parametrize("n", [1, 3, 4])
def test_every_acceptance_count_gives_the_plain_tokens(model, n):
    """Drafts right up to a point, then wrong: each acceptance count from 0 to n rolls back to its own Mamba
    states, with prompt chunks and other sequences' verifications in the same packed steps."""
    plain = generate_ids(model, PROMPTS, max_new_tokens=20)
    for right in range(n + 1):
        engine = oracle_engine(model, plain, n, right, num_blocks=64, block_size=4, max_num_batched_tokens=16)
        out = engine.generate(PROMPTS, max_tokens=20)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], right
        stats = engine.speculative_stats
        assert stats.accepted <= right * stats.rounds and (stats.accepted > 0) == (right > 0)
        if right == n:  # every draft accepted: a round adds n + 1 tokens (fewer drafts near max_tokens: the
            assert stats.acceptance_rate == 1.0  # last token after the first comes from a plain step)
            assert [c.acceptance_rate for c in out] == [1.0] * 3
            assert stats.rounds == 3 * ((20 - 1) // (n + 1) + ((20 - 1) % (n + 1) >= 2))



def test_preemption_and_max_model_len_under_speculation(model):
    """A pool too small for three sequences preempts (drafts dropped, recomputed); max_model_len cuts the drafts
    so a sequence ends exactly where plain decoding ends it."""
    plain = [Engine(model, num_blocks=12, block_size=4, max_num_seqs=3).generate(PROMPTS, max_tokens=14)]
    engine = oracle_engine(model, plain[0], 3, 3, num_blocks=12, block_size=4, max_num_seqs=3)
    out = engine.generate(PROMPTS, max_tokens=14)
    assert engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in out] == [c.token_ids for c in plain[0]]
    short = Engine(model, num_blocks=64, block_size=4, max_model_len=40).generate(PROMPTS, max_tokens=30)
    engine = oracle_engine(model, short, 4, 4, num_blocks=64, block_size=4, max_model_len=40)
    out = engine.generate(PROMPTS, max_tokens=30)
    assert [(c.token_ids, c.finish_reason) for c in out] == [(c.token_ids, c.finish_reason) for c in short]
    assert len(PROMPTS[2]) + len(out[2].token_ids) == 40


def test_stop_id_inside_an_accepted_draft(model):
    (plain,) = generate_ids(model, [PROMPT], max_new_tokens=20)
    stop = plain.token_ids[6]
    plain_stop = Engine(model).generate(PROMPTS, max_tokens=20, stop_ids=[stop])
    engine = oracle_engine(model, generate_ids(model, PROMPTS, max_new_tokens=20), 3, 3)
    out = engine.generate(PROMPTS, max_tokens=20, stop_ids=[stop])
    assert [(c.token_ids, c.finish_reason) for c in out] == [(c.token_ids, c.finish_reason) for c in plain_stop]
    assert out[0].finish_reason == "stop" and out[0].token_ids[-1] == stop


def _pools(model, mtp=False):
    config = model.cache_config
    return BlockPool(config, 16, 4, model.dtype, mtp=mtp), StateSlots(config, 2, model.dtype)


@torch.no_grad()
def test_accept_restores_the_state_after_the_last_accepted_token(model):
    """A verification of 5 tokens accepting 2 leaves the slot's Mamba states of running those 2 (to fp32 rounding:
    the projections ran over 5 tokens), and both sequences continue with the same logits."""
    blocks, slots = _pools(model)
    cache = PagedCache(model.cache_config, blocks, slots)
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]

    def forward(seqs, ids):
        cache.schedule(seqs)
        return model.logits(model.hidden_states(torch.tensor([ids]), cache))[0]

    n = len(PROMPT)
    forward([ScheduledSeq(tables[0], 0, 0, n), ScheduledSeq(tables[1], 1, 0, n)], PROMPT + PROMPT)
    forward([ScheduledSeq(tables[0], 0, n, 5, verify=True), ScheduledSeq(tables[1], 1, n, 2)],
            [7, 8, 9, 10, 11] + [7, 8])
    cache.accept(0, 2)
    for conv, ssm in zip(slots.conv, slots.ssm):
        assert torch.allclose(conv[0], conv[1], atol=1e-5) and torch.allclose(ssm[0], ssm[1], atol=1e-5)
    for k in blocks.k:
        flat = k.flatten(0, 1)
        assert torch.allclose(flat[:n + 2], flat[20:20 + n + 2], atol=1e-6)
    a, b = forward([ScheduledSeq(tables[0], 0, n + 2, 1), ScheduledSeq(tables[1], 1, n + 2, 1)], [3, 3])
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="cannot accept"):
        cache.accept(0, 1)  # the last forward did not verify sequence 0
    forward([ScheduledSeq(tables[0], 0, n + 3, 3, verify=True)], [1, 2, 3])
    with pytest.raises(ValueError, match="cannot accept"):
        cache.accept(0, 4)


@torch.no_grad()
def test_mtp_block_on_the_paged_pool_equals_the_uncached_block(model):
    """The drafter's MTP forward over the pool's MTP keys, fed in two segments, gives the logits of `mtp_logits`
    over the whole sequence (the path training and the tests of the MTP block use)."""
    blocks, slots = _pools(model, mtp=True)
    cache = PagedCache(model.cache_config, blocks, slots, mtp=True)
    ids = torch.tensor([PROMPT])
    _, hidden = model(ids, return_hidden=True)
    next_ids = torch.tensor([PROMPT[1:] + [9]])
    full = model.mtp_logits(hidden, next_ids)
    table = [3, 0, 7]
    cache.schedule([ScheduledSeq(table, 0, 0, 6)])
    first = model.logits(model.mtp_hidden_states(hidden[:, :6], next_ids[:, :6], cache))
    cache.schedule([ScheduledSeq(table, 0, 6, len(PROMPT) - 6)])
    second = model.logits(model.mtp_hidden_states(hidden[:, 6:], next_ids[:, 6:], cache))
    assert torch.allclose(torch.cat([first, second], dim=1), full, atol=1e-5)


def test_sampling_keeps_the_target_distribution():
    """Tiny vocabulary: the joint distribution of three sampled tokens, the second and third after one draft
    from a random MTP block (mostly rejected, so the residual-resampling branch runs, and the bonus token when
    accepted), matches p(t1) p(t2 | t1) p(t3 | t1, t2) computed from the model."""
    V6 = 6
    model = make_model(vocab_size=V6, seed=1, scale=0.8)
    prompt = [1, 4, 2]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)
        exact = torch.zeros(V6, V6, V6)
        for t1 in range(V6):
            p2 = model(torch.tensor([prompt + [t1]]))[0, -1].softmax(-1)
            for t2 in range(V6):
                exact[t1, t2] = p1[t1] * p2[t2] * model(torch.tensor([prompt + [t1, t2]]))[0, -1].softmax(-1)
    n = 4000
    engine = Engine(model, num_blocks=n, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
                    num_speculative_tokens=2)
    out = engine.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=i) for i in range(n)], max_tokens=3)
    counts = torch.zeros(V6, V6, V6)
    for c in out:
        counts[tuple(c.token_ids)] += 1
    # 4000 draws: each cell's standard error is at most sqrt(0.25 / 4000) = 0.008
    assert (counts / n - exact).abs().max() < 0.03, (counts / n - exact).abs().max()
    stats = engine.speculative_stats
    assert stats.drafted == n and 0 < stats.accepted < stats.drafted  # one draft each (max_tokens leaves one)


def test_arguments(model):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        Engine(model, num_speculative_tokens=-1)
    plain = make_model()
    plain.mtp = None
    with pytest.raises(ValueError, match="MTP block"):
        Engine(plain, num_speculative_tokens=1)
    with pytest.raises(ValueError, match="penalties are not supported with speculative"):
        generate_ids(model, [PROMPT], 4, SamplingParams(repetition_penalty=1.2), speculative=2)
    assert Engine(model).speculative_stats is None


def test_a_huge_max_new_tokens_is_not_reserved_up_front():
    """The pool is reserved for at most `RESERVE_AHEAD` new tokens and grows past them: with 10**12 the
    generation runs (to a stop id taken from a short run) instead of failing to allocate."""
    model = make_model(seed=4)
    (short,) = generate_ids(model, [[5, 6, 7]], max_new_tokens=4, speculative=2)
    stop = short.token_ids[-1]
    (c,) = generate_ids(model, [[5, 6, 7]], max_new_tokens=10**12, stop_ids=[stop], speculative=2)
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop


def test_drafts_do_not_depend_on_what_the_prefix_cache_held(model):
    """A seeded sampled request gives the same tokens and acceptances run fresh and resumed from the prefix cache:
    whole (its prompt sent again: the MTP block reruns the last position in a copy of the shared block), and
    partly (a longer prompt resuming at a snapshot on a block boundary). Drafts are the same, so the draws are."""
    prompt = list(range(100, 132))  # 32 tokens: 8 blocks of 4, snapshots every 8
    longer = prompt + [7, 8, 9, 10, 11, 12]
    sampling = SamplingParams(temperature=1.0, seed=5)

    def run(engine, p):
        (c,) = engine.generate([p], sampling, max_tokens=16)
        return c.token_ids, c.acceptance_rate, c.cached_tokens

    fresh = [run(Engine(model, num_blocks=64, block_size=4, num_speculative_tokens=2), p) for p in (prompt, longer)]
    engine = Engine(model, num_blocks=64, block_size=4, prefix_caching=True, snapshot_interval=8,
                    num_speculative_tokens=2)
    first, again, resumed = run(engine, prompt), run(engine, prompt), run(engine, longer)
    assert first[:2] == again[:2] == fresh[0][:2] and again[2] == len(prompt)
    assert resumed[:2] == fresh[1][:2] and resumed[2] == len(prompt)
    assert 0 < first[1] < 1


def test_own_block_copies_a_shared_block_on_write(model):
    """`Scheduler.own_block`: a request's shared block is replaced by a copy (every layer, the MTP block's keys
    too) and the other holder keeps the original; with no free block nothing changes."""
    engine = Engine(model, num_blocks=3, block_size=4, num_speculative_tokens=1)
    pool, scheduler = engine.blocks, engine.scheduler
    shared = pool.allocate()
    pool.hold(shared)
    for t in pool.k + pool.v + pool.mtp_k + pool.mtp_v:
        t[shared].normal_()
    request = type("R", (), {})()
    request.block_table = [shared]
    assert pool.shared(shared) and scheduler.own_block(request, 0)
    own = request.block_table[0]
    assert own != shared and pool.refcount[shared] == 1 and not pool.shared(own)
    assert all(torch.equal(t[own], t[shared]) for t in pool.k + pool.v + pool.mtp_k + pool.mtp_v)
    pool.allocate()  # the last free block
    request.block_table = [shared]
    pool.hold(shared)
    assert not scheduler.own_block(request, 0) and request.block_table == [shared]
