"""Repetition, frequency and presence penalties (`hybrid.sampling.apply_penalties`): against transformers'
`RepetitionPenaltyLogitsProcessor` and a float64 reference of OpenAI's / vLLM's formula, and greedy generation
with them against a full forward over the growing sequence (plain generation, the serving engine and the
prefix cache alike)."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hybrid.generate import generate_ids
from hybrid.prefix_cache import PrefixCache
from hybrid.sampling import PenaltyState, SamplingParams, apply_penalties, penalty_states
from hybrid.serving.engine import Engine
from tiny_checkpoint import write_checkpoint

import hybrid

V = 50


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's order in float64: the repetition penalty over prompt and output tokens, then frequency and
    presence over the output's counts."""
    row = logits.double().clone()
    for v in set(prompt) | set(output):
        x = float(row[v])
        row[v] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for v in set(output):
        row[v] -= params.frequency_penalty * output.count(v) + params.presence_penalty
    return row


def rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    prompts = [[1, 2, 3, 3], [7], [4, 5, 6, 40]]
    outputs = [[3, 9, 9, 9, 11], [], [49, 0, 0, 5]]
    return logits, prompts, outputs


def test_the_repetition_penalty_is_transformers_processor():
    logits, prompts, outputs = rows()
    for penalty in (1.3, 0.7):
        got = apply_penalties(logits, SamplingParams(repetition_penalty=penalty), prompts, outputs)
        for b in range(3):
            ids = torch.tensor([prompts[b] + outputs[b]])
            want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[b:b + 1].clone())[0]
            assert torch.equal(got[b], want), (penalty, b)
        assert not torch.equal(got, logits)


@pytest.mark.parametrize("kwargs", [dict(frequency_penalty=0.5), dict(presence_penalty=-1.2),
                                    dict(frequency_penalty=2.0, presence_penalty=0.4, repetition_penalty=1.5)])
def test_frequency_and_presence_penalties_equal_a_float64_reference(kwargs):
    logits, prompts, outputs = rows()
    params = SamplingParams(**kwargs)
    got = apply_penalties(logits, params, prompts, outputs)
    for b in range(3):
        want = reference(logits[b], params, prompts[b], outputs[b])
        assert torch.allclose(got[b].double(), want, rtol=0, atol=1e-6), b
    if "repetition_penalty" not in kwargs:  # the output only: a token seen only in the prompt keeps its logit
        assert got[0, 1] == logits[0, 1] and got[2, 40] == logits[2, 40] and torch.equal(got[1], logits[1])


def test_each_row_is_penalized_by_its_own_parameters_as_alone_and_none_is_the_identity():
    logits, prompts, outputs = rows()
    per_row = [SamplingParams(frequency_penalty=1.0), SamplingParams(), SamplingParams(repetition_penalty=2.0)]
    together = apply_penalties(logits, per_row, prompts, outputs)
    for b in range(3):
        alone = apply_penalties(logits[b:b + 1], per_row[b], prompts[b:b + 1], outputs[b:b + 1])
        assert torch.equal(together[b], alone[0].float())
    assert torch.equal(together[1], logits[1])
    assert apply_penalties(logits, SamplingParams(), prompts, outputs) is logits
    half = apply_penalties(logits.bfloat16(), SamplingParams(presence_penalty=1.0), prompts, outputs)
    assert half.dtype == torch.float32 and half[0, 9] == logits.bfloat16().float()[0, 9] - 1.0


def test_states_kept_across_steps_equal_recounting_bit_for_bit():
    """The `PenaltyState`s a generation keeps across its steps (the serving engine's and `generate_ids`') give
    the logits that counting each row's prompt and outputs afresh gives, bit for bit, at every step, whatever
    mix of penalties the rows have; none is made for an unpenalized row; outputs that shrink are refused."""
    g = torch.Generator().manual_seed(1)
    per_row = [SamplingParams(repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4), SamplingParams(),
               SamplingParams(repetition_penalty=0.7), SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5)]
    prompts = [[1, 2, 3, 3], [7], [4, 5, 6, 40], [0, 49]]
    outputs = [[] for _ in per_row]
    states = penalty_states(per_row, prompts)
    assert states[1] is None and all(isinstance(s, PenaltyState) for s in (states[0], states[2], states[3]))
    for _ in range(30):  # 30 draws of 50 ids: repeats in every row
        logits = torch.randn(4, V, generator=g) * 3
        got = apply_penalties(logits, per_row, prompts, outputs, states)
        assert torch.equal(got, apply_penalties(logits, per_row, prompts, outputs))
        for out in outputs:
            out.append(int(torch.randint(V, (1,), generator=g)))
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])
    counted = torch.zeros(V, dtype=torch.long).index_put_((states[3].output_ids,), states[3].output_counts)
    assert torch.equal(counted, torch.bincount(torch.tensor(outputs[3][:-1]), minlength=V))
    assert penalty_states(SamplingParams(), prompts) is None
    with pytest.raises(ValueError, match="only grow"):
        apply_penalties(logits, per_row, prompts, [out[:3] for out in outputs], states)


@pytest.mark.parametrize("kwargs, message", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(presence_penalty=True), "presence_penalty")])
def test_bad_penalties_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return hybrid.load(write_checkpoint(tmp_path_factory.mktemp("pen"), pattern="M*EM-M", seed=3), dtype="fp32")


PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4)


@torch.inference_mode()
def penalized_reference(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Oracle: a full forward over the growing sequence (no cache), the float64 penalties, argmax."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        ids.append(int(reference(logits, params, prompt, ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


def test_greedy_generation_with_penalties_equals_the_reference_on_every_path(loaded):
    model, tok = loaded
    prompts = [tok.encode("The grass is green. The grass is green. The grass"), tok.encode("a a a a")]
    params = SamplingParams(**PENALTIES)
    want = [penalized_reference(model, p, 16, params) for p in prompts]
    plain = [(c.token_ids) for c in generate_ids(model, prompts, max_new_tokens=16, sampling=params)]
    free = [c.token_ids for c in generate_ids(model, prompts, max_new_tokens=16)]
    assert plain == want
    assert free != want  # the penalties change these outputs: the test could not pass with them ignored
    engine = Engine(model, num_blocks=64, max_num_seqs=4)
    assert [c.token_ids for c in engine.generate(prompts, params, max_tokens=16)] == want
    cache = PrefixCache(model, snapshot_interval=16)
    assert [c.token_ids for c in generate_ids(model, prompts, 16, params, prefix_cache=cache)] == want


def test_generate_takes_penalties_and_speculative_refuses_them(loaded):
    model, tok = loaded
    (c,) = hybrid.generate(model, tok, "a a a a", max_new_tokens=16, **PENALTIES)
    want = penalized_reference(model, tok.encode("a a a a"), 16, SamplingParams(**PENALTIES))
    if c.finish_reason == "stop":  # generate stops at the tokenizer's stop ids; the reference does not
        want = want[:want.index(c.token_ids[-1]) + 1]
    assert c.token_ids == want
    with pytest.raises(ValueError, match="penalties are not supported with speculative"):
        hybrid.generate(model, tok, "a a", max_new_tokens=4, speculative=2, repetition_penalty=1.2)
