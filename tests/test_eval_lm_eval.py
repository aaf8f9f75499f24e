"""The lm-evaluation-harness adapter: log-likelihoods against direct sums of our model's token log-probs,
generation against hybrid.generate, and an offline niah_single_1 run through lm_eval.simple_evaluate.

Skipped when lm-eval is not installed (it is in the `test` extra; `pip install -e ".[test]"`)."""

from __future__ import annotations

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

import hybrid  # noqa: E402
import hybrid.eval.lm_eval_adapter as adapter  # noqa: E402
from hybrid.eval.lm_eval_adapter import HybridLM  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from tiny_checkpoint import CHAT_TEMPLATE, write_checkpoint  # noqa: E402
from tokenizers import Tokenizer, processors  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lmeval") / "ckpt", "M*E-", seed=3)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@torch.no_grad()
def direct_logprob(model, context_ids, continuation_ids):
    """Sum of log p(continuation token | everything before it) from one full forward, and greedy-ness."""
    ids = torch.tensor([context_ids + continuation_ids])
    logp = torch.log_softmax(model(ids)[0].double(), dim=-1)
    n = len(context_ids)
    targets = torch.tensor(continuation_ids)
    picked = logp[n - 1:-1].gather(-1, targets[:, None])
    return float(picked.sum()), bool(torch.equal(logp[n - 1:-1].argmax(-1), targets))


PAIRS = [
    ("The grass is green. The sky is", " blue."),
    ("The pass key is 12345. Remember it. 12345 is the pass key. What is the pass key? The pass key is", " 12345"),
    ("hello world, the quick brown fox ", "jumps over the lazy dog"),  # trailing space moves to the continuation
    ("", "The sun is yellow."),
]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_loglikelihood_equals_direct_sum(ckpt, batch_size):
    lm = HybridLM(pretrained=str(ckpt), batch_size=batch_size, prefill_chunk_size=16)
    model, tok = hybrid.load(ckpt)
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in PAIRS], disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got):
        if context.endswith(" "):
            context, continuation = context.rstrip(" "), " " + continuation
        if context:
            ctx_ids = tok.encode(context)
            cont_ids = tok.encode(continuation, add_special_tokens=False)
            assert tok.encode(context + continuation) == ctx_ids + cont_ids  # the split is clean here
        else:
            ctx_ids, cont_ids = [tok.token_to_id("<s>")], tok.encode(continuation, add_special_tokens=False)
        want, want_greedy = direct_logprob(model, ctx_ids, cont_ids)
        assert logprob == pytest.approx(want, abs=1e-3)
        assert greedy == want_greedy


def test_loglikelihood_rolling_equals_direct_sum(ckpt):
    text = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
            "hello world, the quick brown fox jumps over the lazy dog; naive cafe 12345")
    model, tok = hybrid.load(ckpt)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 40  # three windows of 16 below
    bos = tok.token_to_id("<s>")
    [whole] = HybridLM(pretrained=str(ckpt)).loglikelihood_rolling([request("loglikelihood_rolling", text)],
                                                                   disable_tqdm=True)
    assert whole == pytest.approx(direct_logprob(model, [bos], ids)[0], abs=1e-3)
    # windows of 16 tokens: each token is predicted once, from up to 16 tokens before it (lm-eval's rule)
    [windowed] = HybridLM(pretrained=str(ckpt), max_length=16).loglikelihood_rolling(
        [request("loglikelihood_rolling", text)], disable_tqdm=True)
    seq = [bos] + ids
    want = 0.0
    for start in range(0, len(ids), 16):
        end = min(start + 16, len(ids))
        first = max(0, end - 16)  # the context of the window: the 16 tokens ending before `end`
        want += direct_logprob(model, seq[first:start + 1], ids[start:end])[0] if start else \
            direct_logprob(model, [bos], ids[:end])[0]
    assert windowed == pytest.approx(want, abs=1e-3)


def test_generate_until_matches_hybrid_generate(ckpt):
    model, tok = hybrid.load(ckpt)
    lm = HybridLM(pretrained=str(ckpt), batch_size=2)
    contexts = ["The grass is green. The sky", "What is the pass key? The pass key is", "hello"]
    kwargs = {"until": ["\n\n", "e"], "max_gen_toks": 10, "do_sample": False}
    got = lm.generate_until([request("generate_until", c, dict(kwargs)) for c in contexts], disable_tqdm=True)
    for context, text in zip(contexts, got):
        [c] = hybrid.generate(model, tok, context, max_new_tokens=10)
        want = c.text
        for stop in kwargs["until"]:
            want = want.split(stop)[0]
        assert text == want


def test_niah_single_1_offline_through_simple_evaluate(ckpt, monkeypatch):
    """RULER niah_single_1 at 1024 tokens on two samples; the tokenizer comes from the checkpoint directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = lm_eval.simple_evaluate(model="hybrid", model_args=f"pretrained={ckpt}", tasks=["niah_single_1"],
                                  metadata={"max_seq_lengths": [1024]}, limit=2, log_samples=True,
                                  gen_kwargs="max_gen_toks=16")
    result = out["results"]["niah_single_1"]
    samples = out["samples"]["niah_single_1"]
    assert len(samples) == 2
    model, tok = hybrid.load(ckpt)
    implied = []
    for s in samples:
        context, gen_kwargs = s["arguments"][0]
        prediction = s["resps"][0][0]
        [c] = hybrid.generate(model, tok, context, max_new_tokens=gen_kwargs["max_gen_toks"])
        assert prediction == c.text
        assert context.endswith("mentioned in the provided text is")
        refs = s["doc"]["outputs"]
        implied.append(sum(r.lower() in prediction.strip().lower() for r in refs) / len(refs))
    assert result["1024,none"] == pytest.approx(sum(implied) / len(implied))


@pytest.fixture(scope="module")
def bos_ckpt(tmp_path_factory):
    """A tokenizer that adds BOS itself (`<s> $A`, as Llama-style ones do) and a chat template that starts with
    `{{ bos_token }}`: encoding the rendered chat with special tokens again would give [1, 1, ...]."""
    directory = write_checkpoint(tmp_path_factory.mktemp("bos") / "ckpt", "M*E-", seed=3)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text("{{ bos_token }}" + CHAT_TEMPLATE)
    return directory


def chat_context(lm, tok):
    """The rendered chat lm-eval's --apply_chat_template sends as the context, and the ids
    hybrid.generate(chat=True) feeds the model for it (one BOS)."""
    messages = [{"role": "user", "content": "The sky is"}]
    context, want = lm.apply_chat_template(messages), tok.encode_chat(messages)
    assert context.startswith("<s><|im_start|>") and want[:2] == [1, 3]
    assert tok.encode(context)[:2] == [1, 1]  # the trap: the rendered BOS, then the tokenizer's own
    return context, want


def test_chat_template_with_bos_loglikelihood_has_one_bos(bos_ckpt):
    model, tok = hybrid.load(bos_ckpt)
    lm = HybridLM(pretrained=str(bos_ckpt))
    context, want = chat_context(lm, tok)
    # the context's trailing "\n" moves to the continuation (lm-eval's rule)
    ctx, cont = tok.encode(context.rstrip(), add_special_tokens=False), tok.encode("\n blue", add_special_tokens=False)
    assert ctx + cont == tok.encode(context + " blue", add_special_tokens=False) and ctx == want[:-1]
    [(logprob, greedy)] = lm.loglikelihood([request("loglikelihood", context, " blue")], disable_tqdm=True)
    want_logprob, want_greedy = direct_logprob(model, ctx, cont)
    assert logprob == pytest.approx(want_logprob, abs=1e-3) and greedy == want_greedy
    assert lm.encode_pair(context, " blue") == (ctx, cont)
    ctx, _ = lm.encode_pair("The sky is", " blue")  # a plain context still gets the tokenizer's BOS, once
    assert ctx == tok.encode("The sky is") and ctx[:1] == [1] and ctx[1] != 1


def test_chat_template_with_bos_generate_until_has_one_bos(bos_ckpt, monkeypatch):
    model, tok = hybrid.load(bos_ckpt)
    lm = HybridLM(pretrained=str(bos_ckpt))
    context, want = chat_context(lm, tok)
    prompts = []
    real = adapter.generate_ids
    monkeypatch.setattr(adapter, "generate_ids", lambda m, p, *a, **k: prompts.extend(p) or real(m, p, *a, **k))
    [text] = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 8})],
                               disable_tqdm=True)
    assert prompts == [want]
    [c] = hybrid.generate(model, tok, "The sky is", max_new_tokens=8, chat=True)
    assert text == c.text


@pytest.mark.parametrize("off", [0, -1])
def test_generation_kwargs_top_k_zero_or_minus_one_is_off(ckpt, off):
    lm = HybridLM(pretrained=str(ckpt))
    kwargs = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 0.9}
    texts = []
    for extra in ({"top_k": off}, {}):
        torch.manual_seed(7)  # the adapter draws from torch's global generator, as lm-eval's HF model does
        texts += lm.generate_until([request("generate_until", "hello", {**kwargs, **extra})], disable_tqdm=True)
    assert texts[0] == texts[1]
