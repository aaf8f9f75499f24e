"""Generation: sampling rules, stop ids, batches with left padding, streaming, speed fields."""

import pytest
import torch

import hybrid
from hybrid.generate import generate_ids
from hybrid.sampling import SamplingParams, sample
from tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return hybrid.load(write_checkpoint(tmp_path_factory.mktemp("gen"), pattern="M*EM-M", seed=3))


def greedy_reference(model, prompt, n):
    """Oracle: full forward over the growing sequence, no cache, argmax each time."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_full_forward_argmax(loaded):
    model, tok = loaded
    prompt = tok.encode("The pass key is 12345.")
    (c,) = generate_ids(model, [prompt], max_new_tokens=12)
    assert c.token_ids == greedy_reference(model, prompt, 12)
    assert c.finish_reason == "length" and c.prompt_tokens == len(prompt)


def test_batch_rows_equal_rows_alone(loaded):
    model, tok = loaded
    prompts = [tok.encode(t) for t in ("hello", "The grass is green. The sky is blue.", "a", "東京 café")]
    together = generate_ids(model, prompts, max_new_tokens=10)
    for p, c in zip(prompts, together):
        (alone,) = generate_ids(model, [p], max_new_tokens=10)
        assert c.token_ids == alone.token_ids


def test_chunked_prefill_equals_one_pass(loaded):
    model, tok = loaded
    prompt = tok.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. " * 3)
    (a,) = generate_ids(model, [prompt], max_new_tokens=8)
    (b,) = generate_ids(model, [prompt], max_new_tokens=8, prefill_chunk_size=7)
    assert a.token_ids == b.token_ids


def test_stop_id_ends_generation(loaded):
    model, tok = loaded
    prompt = tok.encode("hello world")
    (free,) = generate_ids(model, [prompt], max_new_tokens=10)
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    (c,) = generate_ids(model, [prompt], max_new_tokens=10, stop_ids=[stop])
    assert c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[: first + 1]


def test_text_streaming_and_stop_token_hidden(loaded):
    model, tok = loaded
    (free,) = hybrid.generate(model, tok, "hello world", max_new_tokens=8)
    tok_stop = list(tok.stop_ids)
    tok.stop_ids = tok_stop + [free.token_ids[5]]
    try:
        pieces = []
        (c,) = hybrid.generate(model, tok, "hello world", max_new_tokens=8, on_text=lambda row, t: pieces.append(t))
    finally:
        tok.stop_ids = tok_stop
    assert c.finish_reason == "stop"
    assert c.text == tok.decode(c.token_ids[:-1])
    assert "".join(pieces) == c.text
    assert c.prefill_seconds > 0 and c.decode_seconds >= 0 and c.prefill_tokens_per_s > 0


def test_stop_ids_are_the_union(loaded):
    _, tok = loaded
    # config.json eos 2 (</s>), generation_config eos 2, tokenizer eos <|im_end|> = 4
    assert tok.stop_ids == [2, 4]


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])
    assert sample(logits, SamplingParams()).item() == 1
    assert sample(torch.tensor([[1.0, 5.0, 5.0]]), SamplingParams()).item() == 1  # ties: lowest id
    draws = [sample(logits, SamplingParams(temperature=1.0, top_k=2, seed=s)).item() for s in range(200)]
    assert set(draws) == {1, 2}
    # top_p: p(1)=0.49, p(2)=0.44 under softmax; 0.5 keeps exactly {1, 2}
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=s)).item() for s in range(200)]
    assert set(draws) == {1, 2}
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.3, seed=s)).item() for s in range(50)]
    assert set(draws) == {1}
    a = [sample(logits, SamplingParams(temperature=1.0, seed=7)).item() for _ in range(5)]
    b = [sample(logits, SamplingParams(temperature=1.0, seed=7)).item() for _ in range(5)]
    assert a == b


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1.0, seed=0)
    n = 4000
    counts = torch.bincount(torch.cat([sample(logits.expand(n, 3), params)]), minlength=3).float() / n
    expected = logits.softmax(-1)[0]
    assert torch.allclose(counts, expected, atol=0.03)  # 4000 draws: std <= 0.008


def test_a_batch_of_rows_with_their_own_parameters_draws_each_rows_distribution():
    """One batched draw over rows with different temperatures and filters: each row's frequencies follow its
    own filtered distribution, computed in float64 (softmax at its temperature; min_p drops ids under min_p times
    the most likely; top_k / top_p keep the best), and a greedy row is its argmax."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 1.5])
    kinds = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5, seed=2),
             SamplingParams(), SamplingParams(temperature=2.0, min_p=0.5, seed=3),
             SamplingParams(temperature=1.0, top_k=2, seed=4), SamplingParams(temperature=1.0, top_p=0.6, seed=5)]
    n = 3000
    rows = [p for p in kinds for _ in range(n)]
    ids = sample(logits.expand(len(rows), 5), rows).reshape(len(kinds), n)
    x = logits.double()
    expected = [(x / 1.0).softmax(-1), (x / 0.5).softmax(-1), torch.nn.functional.one_hot(x.argmax(), 5).double()]
    p = (x / 2.0).softmax(-1)
    expected.append(torch.where(p >= 0.5 * p.max(), p, 0) / torch.where(p >= 0.5 * p.max(), p, 0).sum())
    top2 = torch.zeros(5, dtype=torch.float64)
    top2[[2, 4]] = x[[2, 4]].softmax(-1)
    expected.append(top2)
    p = x.softmax(-1)  # top_p 0.6: 2 (0.46) then 4 (0.28) reach it
    top_p = torch.zeros(5, dtype=torch.float64)
    top_p[[2, 4]] = p[[2, 4]] / p[[2, 4]].sum()
    expected.append(top_p)
    for row, want in zip(ids, expected):
        got = torch.bincount(row, minlength=5).double() / n
        assert torch.allclose(got, want, atol=0.03), (got, want)  # 3000 draws: std <= 0.0092


def test_a_seeded_row_draws_the_same_token_in_any_batch_as_alone():
    """Each seeded row's noise comes from its own generator: beside other rows, seeded or not, greedy or not,
    it draws what it draws alone, step after step; the ids stay on the logits' device."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 300, generator=g)
    batch = [SamplingParams(temperature=0.8, seed=7, top_p=0.9), SamplingParams(temperature=1.0),
             SamplingParams(), SamplingParams(temperature=1.2, seed=8, min_p=0.05, top_k=40)]
    alone = [SamplingParams(temperature=0.8, seed=7, top_p=0.9), SamplingParams(temperature=1.2, seed=8, min_p=0.05,
                                                                                     top_k=40)]
    for step in range(6):
        got = sample(logits[:, step], batch)
        assert got.dtype == torch.int64 and got.device == logits.device
        assert int(got[0]) == int(sample(logits[0:1, step], alone[0]))
        assert int(got[3]) == int(sample(logits[3:4, step], alone[1]))
        assert int(got[2]) == int(logits[2, step].argmax())


def test_generator_on_the_cpu_is_the_seeded_generator():
    p = SamplingParams(temperature=1.0, seed=3)
    assert p.generator_on("cpu") is p.generator and SamplingParams(temperature=1.0).generator_on("cpu") is None
    assert p.fresh()._device_generators == {} and p.fresh().generator is not p.generator


def test_per_row_sampling_params_equal_each_row_alone(loaded):
    """Each row of a batch with its own temperature, filters and seed gives exactly the tokens it gives alone
    with the same parameters (its own generator), whatever the other rows do; a greedy row is the greedy
    reference."""
    model, tok = loaded
    prompts = [tok.encode(t) for t in ("hello", "The grass is green.", "a", "The pass key is")]
    params = lambda: [SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(temperature=0.7,  # noqa: E731
                      top_k=5, seed=2), SamplingParams(temperature=1.3, top_p=0.8, seed=3)]
    together = generate_ids(model, prompts, max_new_tokens=12, sampling=params())
    for row, (p, c) in enumerate(zip(prompts, together)):
        (alone,) = generate_ids(model, [p], max_new_tokens=12, sampling=params()[row])
        assert c.token_ids == alone.token_ids, row
    assert together[1].token_ids == greedy_reference(model, prompts[1], 12)
    draws = [sample(torch.zeros(2, 50), [SamplingParams(temperature=1.0, seed=s), SamplingParams(temperature=1.0, seed=s)])
             for s in range(4)]
    assert all(int(d[0]) == int(d[1]) for d in draws)  # same seed, same row draw
    with pytest.raises(ValueError, match="2 sampling parameter sets for 3 rows"):
        sample(torch.zeros(3, 5), [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=True), "min_p")])
def test_bad_sampling_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_generate_arguments(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="non-empty"):
        generate_ids(model, [[]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ids(model, [[1]], max_new_tokens=0)
