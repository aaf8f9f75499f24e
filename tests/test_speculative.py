"""Speculative decoding with the MTP block: exactness of greedy output, rollback of the hybrid state, and
the target distribution under sampling."""

import pytest
import torch

from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams
from hybrid.speculative import speculative_generate_ids
from tiny_checkpoint import random_model


def make_model(vocab_size=320, seed=0, scale=0.3):
    return random_model("M*EM-", seed, scale, vocab_size=vocab_size, num_nextn_predict_layers=1, mtp_pattern="*E")


@pytest.fixture(scope="module")
def model():
    return make_model()


PROMPT = [5, 17, 3, 99, 250, 7, 42, 11, 64, 128, 33]


@pytest.mark.parametrize("num_draft", [1, 2, 3, 5])
def test_greedy_equals_plain_greedy_with_random_drafts(model, num_draft):
    (plain,) = generate_ids(model, [PROMPT], max_new_tokens=24)
    spec, stats = speculative_generate_ids(model, PROMPT, max_new_tokens=24, num_draft=num_draft)
    assert spec.token_ids == plain.token_ids
    assert stats.drafted > 0 and stats.accepted < stats.drafted  # random MTP weights: most drafts rejected


@pytest.mark.parametrize("num_draft", [1, 3, 4])
def test_greedy_with_a_draft_that_is_always_right(model, num_draft):
    (plain,) = generate_ids(model, [PROMPT], max_new_tokens=20)
    truth = PROMPT + plain.token_ids

    def oracle(position, tokens):
        probs = torch.zeros(320)
        probs[truth[position]] = 1.0
        return truth[position], probs

    spec, stats = speculative_generate_ids(model, PROMPT, max_new_tokens=20, num_draft=num_draft, drafter=oracle)
    assert spec.token_ids == plain.token_ids
    assert stats.acceptance_rate == 1.0
    assert stats.rounds == -(-(20 - 1) // (num_draft + 1))  # each round adds num_draft + 1 tokens


def test_stop_id_inside_an_accepted_draft(model):
    (plain,) = generate_ids(model, [PROMPT], max_new_tokens=20)
    stop = plain.token_ids[6]
    (plain_stop,) = generate_ids(model, [PROMPT], max_new_tokens=20, stop_ids=[stop])
    spec, _ = speculative_generate_ids(model, PROMPT, max_new_tokens=20, num_draft=3, stop_ids=[stop])
    assert spec.token_ids == plain_stop.token_ids and spec.finish_reason == "stop"


def test_rollback_restores_the_hybrid_state(model):
    """A recorded forward of 5 tokens rolled back to 2 leaves the state of running those 2 (to fp32 rounding:
    the projections run batched over 5 tokens instead of 2)."""
    a, b = model.new_cache(1), model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), a)
        model(torch.tensor([PROMPT]), b)
        model(torch.tensor([[7, 8, 9, 10, 11]]), a, record=True)
        a.rollback(2)
        model(torch.tensor([[7, 8]]), b)
        assert a.seq_len == b.seq_len == len(PROMPT) + 2
        for la, lb in zip(a.layers, b.layers):
            if hasattr(la, "ssm"):
                assert torch.allclose(la.conv, lb.conv, atol=1e-5) and torch.allclose(la.ssm, lb.ssm, atol=1e-5)
            elif la is not None:
                assert torch.allclose(la.k[:, :, : a.seq_len], lb.k[:, :, : b.seq_len], atol=1e-6)
        # and both continue identically
        assert torch.allclose(model(torch.tensor([[3]]), a), model(torch.tensor([[3]]), b), atol=1e-5)


def test_rollback_errors(model):
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache)
    with pytest.raises(ValueError, match="recorded forward"):
        cache.rollback(1)
    with pytest.raises(ValueError, match="cannot rewind Mamba"):
        cache.truncate(3)


def test_sampling_keeps_the_target_distribution():
    """Tiny vocabulary: the joint distribution of two sampled tokens, drawn with random-MTP drafts (most
    rejected, so the residual-resampling branch runs), matches p(t1) p(t2 | t1) computed from the model."""
    V = 6
    model = make_model(vocab_size=V, seed=1, scale=0.8)
    prompt = [1, 4, 2]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)
        exact = torch.zeros(V, V)
        for t1 in range(V):
            exact[t1] = p1[t1] * model(torch.tensor([prompt + [t1]]))[0, -1].softmax(-1)
    n = 3000
    counts = torch.zeros(V, V)
    sampling = SamplingParams(temperature=1.0, seed=0)
    accepted = drafted = 0
    for _ in range(n):
        c, stats = speculative_generate_ids(model, prompt, max_new_tokens=2, num_draft=2, sampling=sampling)
        counts[c.token_ids[0], c.token_ids[1]] += 1
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    empirical = counts / n
    # 3000 draws: each cell's standard error is at most sqrt(0.25 / 3000) = 0.009
    assert (empirical - exact).abs().max() < 0.035, (empirical - exact).abs().max()
    assert 0 < accepted < drafted


def test_arguments(model):
    with pytest.raises(ValueError, match="not a tensor"):
        speculative_generate_ids(model, torch.tensor(PROMPT))
    with pytest.raises(ValueError, match="num_draft"):
        speculative_generate_ids(model, PROMPT, num_draft=0)
    plain = make_model()
    plain.mtp = None
    with pytest.raises(ValueError, match="MTP block"):
        speculative_generate_ids(plain, PROMPT)


def test_mtp_step_on_a_cache_equals_the_uncached_block(model):
    """The drafter's cached MTP forward, fed in two segments, gives the logits of `mtp_logits` over the
    whole sequence (the path training and the tests of the MTP forward use)."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        _, hidden = model(ids, return_hidden=True)
        next_ids = torch.tensor([PROMPT[1:] + [9]])
        full = model.mtp_logits(hidden, next_ids)
        mtp_cache = model.new_mtp_cache(1)
        first, _ = model.mtp_step(hidden[:, :6], next_ids[:, :6], mtp_cache)
        second, _ = model.mtp_step(hidden[:, 6:], next_ids[:, 6:], mtp_cache)
    assert torch.allclose(torch.cat([first, second], dim=1), full, atol=1e-5)


def test_a_huge_max_new_tokens_is_not_reserved_up_front():
    """The caches are reserved for at most `RESERVE_AHEAD` new tokens and grow past them: with 10**12 the
    generation runs (to a stop id taken from a short run) instead of failing to allocate."""
    model = make_model(seed=4)
    short, _ = speculative_generate_ids(model, [5, 6, 7], max_new_tokens=4, num_draft=2)
    stop = short.token_ids[2]
    c, _ = speculative_generate_ids(model, [5, 6, 7], max_new_tokens=10**12, num_draft=2, stop_ids=[stop])
    assert c.token_ids[-1] == stop and c.token_ids == short.token_ids[: len(c.token_ids)]
