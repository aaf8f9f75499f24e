"""Bad or unusual inputs: token ids outside the vocabulary, padding ids of any kind, degenerate sampling
numbers, and a property test of the sampling filters (issue 15)."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer

import hybrid
from hybrid.batch import left_pad
from hybrid.generate import generate_ids
from hybrid.sampling import SAMPLING_EPS, SamplingParams, sample
from tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("robust"), "M*E-", seed=1)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return hybrid.load(ckpt, progress=False)


def add_pad_past_vocab(directory) -> int:
    """Add a `[PAD]` token after the tokenizer's last entry and make it the pad token; return its id."""
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["[PAD]"])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "[PAD]"}))
    return tok.token_to_id("[PAD]")


# ---------------------------------------------------------------------------------- ids outside the vocab
@pytest.mark.parametrize("bad", [320, -1, 10**6])
def test_id_outside_vocabulary_is_a_clear_error(loaded, bad):
    model, _ = loaded
    message = rf"token id {bad} \({{}}\) is outside the model's vocabulary: ids must lie in \[0, 320\)"
    with pytest.raises(ValueError, match=message.format(r"prompts\[1\]\[1\]")):  # the prompt, by row and position
        generate_ids(model, [[5, 6], [5, bad]], max_new_tokens=2)
    with pytest.raises(ValueError, match=message.format(r"input_ids\[1, 1\]")):
        model(torch.tensor([[5, 6], [5, bad]]))
    with pytest.raises(ValueError, match="input_ids must hold integer token ids, got torch.float32"):
        model(torch.tensor([[5.0, 6.0]]))
    (c,) = generate_ids(model, [[5, 319]], max_new_tokens=2)  # the last id is fine
    assert len(c.token_ids) == 2


def test_tokenizer_past_vocabulary_is_noted_and_pad_there_works(tmp_path):
    """A `[PAD]` added past vocab_size (a Hugging Face idiom): load notes it, padding with it works, feeding
    it as a real token is the clear error."""
    directory = write_checkpoint(tmp_path / "ck", "M*E-", seed=1)
    pad = add_pad_past_vocab(directory)
    assert pad == 320
    with pytest.warns(UserWarning, match=r"1 token past the model's vocabulary \(config.vocab_size 320\): "
                                         r"'\[PAD\]' = 320; it cannot be fed to the model"):
        model, tok = hybrid.load(directory, progress=False)
    assert tok.pad_token_id == 320
    prompts = ["hello", "The grass is green. The sky"]
    together = hybrid.generate(model, tok, prompts, max_new_tokens=6)
    for prompt, c in zip(prompts, together):
        (alone,) = hybrid.generate(model, tok, prompt, max_new_tokens=6)
        assert c.token_ids == alone.token_ids
    with pytest.raises(ValueError, match=r"token id 320 .* \[0, 320\)"):
        generate_ids(model, [[5, pad]], max_new_tokens=1)
    with warnings.catch_warnings():  # a tokenizer inside the vocabulary: no note
        warnings.simplefilter("error")
        hybrid.load(write_checkpoint(tmp_path / "plain", "M*E-", seed=1), progress=False)


# ---------------------------------------------------------------------------------- padding ids
@pytest.mark.parametrize("pad_id", [0, "inside", None, 320, -1])
def test_batch_rows_equal_rows_alone_whatever_the_pad_id(loaded, pad_id):
    model, tok = loaded
    prompts = [tok.encode(t) for t in ("hello", "The grass is green. The sky is blue.", "a", "The pass key is")]
    if pad_id == "inside":
        pad_id = prompts[1][0]
        assert pad_id == prompts[3][0]  # "The": a real token of the prompts
    together = generate_ids(model, prompts, max_new_tokens=8, pad_id=pad_id, prefill_chunk_size=5)
    batch = left_pad(prompts, pad_id)
    with torch.inference_mode():
        logits = model(batch.ids, attention_mask=batch.mask)  # a padded batch without a cache (scoring)
    for row, (p, c) in enumerate(zip(prompts, together)):
        (alone,) = generate_ids(model, [p], max_new_tokens=8)
        assert c.token_ids == alone.token_ids, row
        with torch.inference_mode():
            want = model(torch.tensor([p]))[0]
        torch.testing.assert_close(logits[row, batch.offsets[row]:], want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- sampling numbers
@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), "top_k must be a positive integer, or 0 or -1 for no limit, got -2"),
    (dict(top_k=2.5), "top_k must be a positive integer, or 0 or -1 for no limit, got 2.5"),
    (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),
])
def test_degenerate_sampling_numbers_are_rejected(loaded, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    model, tok = loaded
    with pytest.raises(ValueError, match=message):
        hybrid.generate(model, tok, "hi", max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 9.99e-6])
def test_tiny_temperature_is_greedy(loaded, temperature):
    model, tok = loaded
    assert SamplingParams(temperature).temperature == 0.0
    (greedy,) = hybrid.generate(model, tok, "The grass is", max_new_tokens=6)
    (tiny,) = hybrid.generate(model, tok, "The grass is", max_new_tokens=6, temperature=temperature, seed=3)
    assert tiny.token_ids == greedy.token_ids
    assert SamplingParams(SAMPLING_EPS).temperature == SAMPLING_EPS  # the cut-off itself samples


@pytest.mark.parametrize("off", [0, -1, None])
def test_top_k_zero_or_minus_one_is_off(off):
    assert SamplingParams(1.0, top_k=off).top_k is None
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]]).expand(200, 4)
    assert set(sample(logits, SamplingParams(1.0, top_k=off, seed=0)).tolist()) == {0, 1, 2, 3}
    assert SamplingParams(1.0, top_k=3).top_k == 3


# ---------------------------------------------------------------------------------- property: kept set
def allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Ids the filters may keep, computed independently in float64: min-p keeps ids at least min_p times as
    likely as the most likely (within float32 rounding); top-k keeps ids with fewer than k strictly larger
    scaled logits; top-p keeps an id when the mass of the strictly more likely survivors is at most top_p (the
    smallest prefix reaching top_p, ties either way); greedy keeps the lowest argmax."""
    if params.temperature == 0:
        return {int(logits.argmax())}
    scaled = (logits.float() / params.temperature).double()  # the same rounding as the sampler's input
    ids = range(len(scaled))
    full = scaled.softmax(-1)
    keep = [i for i in ids if full[i] >= params.min_p * full.max() * (1 - 1e-5)]
    keep = [i for i in keep if params.top_k is None or int((scaled > scaled[i]).sum()) < params.top_k]
    probs = torch.full_like(scaled, 0.0)
    probs[keep] = scaled[keep].softmax(-1)
    if params.top_p is not None:
        keep = [i for i in keep if float(probs[probs > probs[i]].sum()) <= params.top_p + 1e-5]
    return set(keep)


temperatures = st.one_of(st.just(0.0), st.floats(1e-9, SAMPLING_EPS, exclude_max=True), st.floats(0.05, 5.0))


@settings(max_examples=80, deadline=None)
@given(logits=st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=2, max_size=40),
       temperature=temperatures, top_k=st.one_of(st.none(), st.integers(-1, 45)),
       top_p=st.one_of(st.none(), st.floats(1e-3, 1.0)), seed=st.integers(0, 2**31 - 1),
       min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
def test_sampled_ids_lie_in_the_kept_set(logits, temperature, top_k, top_p, seed, min_p):
    params = SamplingParams(temperature, top_k, top_p, seed, min_p=min_p)
    row = torch.tensor(logits)
    draws = set(sample(row.expand(64, len(logits)), params).tolist())
    kept = allowed(row, params)
    assert draws <= kept, (draws - kept, kept)
    assert all(0 <= i < len(logits) for i in draws) and not math.isnan(row.sum())


# ---------------------------------------------------------------------------------- new-user trial faults
VOCAB_RE = r"\[0, 320\)"


@pytest.mark.parametrize("limit", [10**9, 2**31, 10**12, 10**22])
def test_huge_max_new_tokens_runs_until_a_stop(loaded, limit):
    """The KV cache is not reserved for the whole limit up front: generation runs until a stop id."""
    model, _ = loaded
    (c,) = generate_ids(model, [[5, 6]], max_new_tokens=limit, stop_ids=list(range(320)))
    assert len(c.token_ids) == 1 and c.finish_reason == "stop"


@pytest.mark.parametrize("bad", [2.5, True, "3", None, 0, -4])
def test_max_new_tokens_must_be_a_positive_int(loaded, bad):
    model, tok = loaded
    message = rf"max_new_tokens must be an integer >= 1, got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=message):
        generate_ids(model, [[5, 6]], max_new_tokens=bad)
    with pytest.raises(ValueError, match=message):
        hybrid.generate(model, tok, "hi", max_new_tokens=bad)


def test_past_max_position_embeddings_is_noted_once(tmp_path):
    model, _ = hybrid.load(write_checkpoint(tmp_path, "M*E-", seed=1, max_position_embeddings=8), progress=False)
    with pytest.warns(UserWarning, match=r"max_position_embeddings \(8\)") as notes:
        (c,) = generate_ids(model, [[5, 6, 7, 8, 9]], max_new_tokens=10)
    assert len(c.token_ids) == 10 and c.finish_reason == "length"
    assert len([n for n in notes if "max_position_embeddings" in str(n.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_ids(model, [[5, 6]], max_new_tokens=6)  # 8 positions: within the limit, no note


@pytest.mark.parametrize("bad, what", [
    (2**63, r"token id 9223372036854775808 \(prompts\[1\]\[1\]\) is outside the model's vocabulary: ids must lie in "
            + VOCAB_RE),
    (-2**70, r"token id -1180591620717411303424 \(prompts\[1\]\[1\]\) is outside the model's vocabulary"),
    (3.5, r"prompts\[1\]\[1\] must be a Python int token id in " + VOCAB_RE + r" \(config.vocab_size\), got 3.5"),
    (True, r"prompts\[1\]\[1\] must be a Python int token id in " + VOCAB_RE + r" \(config.vocab_size\), got True"),
    ("7", r"prompts\[1\]\[1\] must be a Python int token id in " + VOCAB_RE + r" \(config.vocab_size\), got '7'"),
    (None, r"prompts\[1\]\[1\] must be a Python int token id in " + VOCAB_RE + r" \(config.vocab_size\), got None"),
])
def test_prompt_ids_are_checked_at_the_entry(loaded, bad, what):
    model, _ = loaded
    with pytest.raises(ValueError, match=what):
        generate_ids(model, [[5, 6], [5, bad]], max_new_tokens=2)


@pytest.mark.parametrize("prompts, what", [
    ([], r"prompts must be a non-empty list of token id lists"),
    ("hello", r"prompts must be a non-empty list of token id lists, got 'hello'"),
    ([[5], []], r"prompts\[1\] is empty"),
    ([[5], 6], r"prompts\[1\] must be a list of token ids, got 6"),
    ([[5], "ab"], r"prompts\[1\] must be a list of token ids, got 'ab'"),
])
def test_prompt_lists_are_checked_at_the_entry(loaded, prompts, what):
    model, _ = loaded
    with pytest.raises(ValueError, match=what):
        generate_ids(model, prompts, max_new_tokens=2)


def test_forward_refuses_no_tokens_and_a_mask_that_is_not_0_1(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match=r"input_ids has no tokens \(shape \(1, 0\)\)"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1 \(or True and False\), got 2"):
        model(torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1 \(or True and False\), got -1"):
        model(torch.tensor([[5, 6]]), attention_mask=torch.tensor([[-1, 1]]))
    ok = model(torch.tensor([[5, 6]]), attention_mask=torch.tensor([[0, 1]]))
    torch.testing.assert_close(ok[:, -1], model(torch.tensor([[6]]))[:, -1], atol=2e-5, rtol=1e-5)


def test_text_prompts_that_are_not_str_or_not_utf8(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match=r"prompts\[1\] is not valid UTF-8: byte 0xff at character 1"):
        hybrid.generate(model, tok, ["ok", "a\udcffb"], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\] is not valid UTF-8: character '\\ud800' at character 0"):
        hybrid.generate(model, tok, "\ud800", max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a str, got bytes b'hi'"):
        hybrid.generate(model, tok, [b"hi"], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompts must be a str or a list of str, got 5"):
        hybrid.generate(model, tok, 5, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts must be a non-empty list"):
        hybrid.generate(model, tok, [], max_new_tokens=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature="0.7"), "temperature must be a finite number >= 0, got '0.7'"),
    (dict(temperature=True), "temperature must be a finite number >= 0, got True"),
    (dict(seed="1"), r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got '1'"),
    (dict(seed=True), r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got True"),
    (dict(top_k=True), "top_k must be a positive integer, or 0 or -1 for no limit, got True"),
    (dict(top_k="5"), "top_k must be a positive integer, or 0 or -1 for no limit, got '5'"),
    (dict(top_p="0.9"), r"top_p must be in \(0, 1\], got '0.9'"),
    (dict(top_p=True), r"top_p must be in \(0, 1\], got True"),
])
def test_sampling_types_are_named_with_repr(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad, message", [
    ({"temperature": 1.0}, r"sampling must be a SamplingParams or a list of one per row, got dict"),
    ("greedy", r"sampling must be a SamplingParams or a list of one per row, got str"),
    ([SamplingParams(), {"temperature": 1.0}], r"sampling\[1\] must be a SamplingParams, got dict"),
    ([SamplingParams()] * 3, r"3 sampling parameter sets for 1 rows"),
])
def test_sampling_argument_type_is_checked(loaded, bad, message):
    model, _ = loaded
    with pytest.raises(ValueError, match=message):
        generate_ids(model, [[5, 6]], max_new_tokens=2, sampling=bad)


def test_a_seeded_params_object_reproduces_in_every_call(loaded):
    model, _ = loaded
    params = SamplingParams(temperature=1.5, seed=1)
    first = generate_ids(model, [[5, 6]], max_new_tokens=16, sampling=params)[0].token_ids
    second = generate_ids(model, [[5, 6]], max_new_tokens=16, sampling=params)[0].token_ids
    assert first == second
    assert first == generate_ids(model, [[5, 6]], max_new_tokens=16,
                                 sampling=SamplingParams(temperature=1.5, seed=1))[0].token_ids
    rows = [SamplingParams(temperature=1.5, seed=1), SamplingParams(temperature=1.5, seed=7)]
    together = generate_ids(model, [[5, 6], [9, 10, 11]], max_new_tokens=16, sampling=rows)
    again = generate_ids(model, [[5, 6], [9, 10, 11]], max_new_tokens=16, sampling=rows)
    assert [c.token_ids for c in together] == [c.token_ids for c in again]
    assert together[0].token_ids == first  # a row's tokens do not depend on its batch
    alone = generate_ids(model, [[9, 10, 11]], max_new_tokens=16, sampling=rows[1])[0].token_ids
    assert together[1].token_ids == alone
