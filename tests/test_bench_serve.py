"""scripts/bench_serve.py --quick: the load bench runs end to end against a real `hybrid serve` process and
reports real figures; the soak's correctness check compares responses and catches a wrong one (no timing is
asserted)."""

import contextlib
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_serve  # noqa: E402
from bench_serve import Response, check_responses, percentile, text_of_tokens  # noqa: E402


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`bench_serve.py --quick`, run in this process (its server is a process of its own), with the soak
    reference of one prompt made wrong: the server's responses to it then differ from it, so they must be
    replayed (`GreedyVerifier`) and found greedy, while every other response equals its reference."""
    tmp = tmp_path_factory.mktemp("serve_bench")
    out = tmp / "serve_bench.json"
    original, calls = bench_serve.truncated, []

    def truncated(reference, max_tokens, tokenizer):
        ref = original(reference, max_tokens, tokenizer)
        calls.append(ref)
        if len(calls) == 1:  # the first soak prompt's
            ref = {**ref, "text": ref["text"] + " (not what the model says)"}
        return ref

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(bench_serve, "truncated", truncated)
        code = bench_serve.main(["--quick", "--threads", "2", "--workdir", str(tmp / "work"), "--out", str(out)])
    assert code == 0 and len(calls) == 8
    return json.loads(out.read_text()), stdout.getvalue(), tmp / "work" / "tiny"


def test_quick_levels_have_real_numbers(quick):
    report, stdout, _ = quick
    assert report["clients"] == [1, 4] and report["target_level"] == 4
    for clients in ("1", "4"):
        level = report["ours"]["levels"][clients]
        assert level["errors"] == 0 and level["requests"] == 8
        assert 0 < level["generated_tokens"] <= 8 * report["max_tokens"]
        for key in ("tok_s", "decode_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "peak_rss_bytes"):
            assert _positive(level[key]), (clients, key, level[key])
        assert level["ttft_p50_s"] <= level["ttft_p99_s"] and level["itl_p50_s"] <= level["itl_p99_s"]
        # the warm-up left the 512-token system prompt cached: every request resumes after it
        assert level["cached_tokens"] >= 8 * report["prompts"]["system_tokens"]
        assert level["prefix_hits_per_admission"] == 1.0
        # the printed row carries the same numbers
        row = re.search(rf"^hybrid serve\s+{clients}\s+8\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", stdout, re.M)
        assert row, stdout
        assert float(row.group(1)) == pytest.approx(level["tok_s"], abs=0.06)
        assert float(row.group(2)) == pytest.approx(level["decode_tok_s"], abs=0.06)
        assert float(row.group(4)) == pytest.approx(level["ttft_p99_s"], abs=6e-4)
    seq = report["sequential"]
    assert _positive(seq["tok_s"]) and _positive(seq["batch1_decode_tok_s"])
    assert seq["cached_tokens_min"] >= report["prompts"]["system_tokens"]


def test_quick_long_prompt_and_targets(quick):
    report, stdout, _ = quick
    long, cost = report["long_prompt"], report["chunk_and_step"]
    assert long["long_prompt_tokens"] >= 1900 and long["itl_samples"] > 0 and _positive(long["itl_p99_s"])
    assert cost["chunks"] >= 3 and _positive(cost["chunk_max_s"]) and _positive(cost["decode_step_s"])
    names = [t["target"] for t in report["targets"]]
    assert any("batch-1 decode" in n for n in names) and any("sequential" in n for n in names)
    assert any("TTFT" in n for n in names) and any("chunk + step" in n for n in names)
    ratio = next(t for t in report["targets"] if "sequential" in t["target"])
    assert ratio["value"] == pytest.approx(report["ours"]["levels"]["4"]["tok_s"] / report["sequential"]["tok_s"], rel=1e-2)
    assert "llama.cpp" not in report  # --quick leaves the peer out
    assert stdout.count("pass") + stdout.count("fall short") == len(report["targets"])


def test_quick_soak_compares_responses_and_frees_everything(quick):
    report, _, _ = quick
    soak = report["soak"]
    assert soak["requests"] == 40 and soak["disconnected"] == 4 and soak["errors"] == 0
    assert soak["compared"] == 36  # every completed response was compared with its reference
    # the responses to the prompt whose reference was spoilt differ from it; replayed once, they are greedy
    assert soak["replayed"] == 1 and 1 <= soak["greedy_up_to_ties"] <= 5 and soak["ties"] == 0
    assert soak["equal"] + soak["greedy_up_to_ties"] == soak["compared"] and soak["wrong"] == 0 and soak["correct"]
    assert report["ours"]["levels"]["4"]["equal_to_reference"] == 8 and "replay" in report["ours"]["levels"]["4"]
    assert soak["all_free"] and soak["after"] == {"requests_running": 0, "requests_waiting": 0, "kv_blocks_used": 0,
                                                  "state_slots_used": 0}
    assert _positive(soak["rss_before_bytes"]) and _positive(soak["rss_after_bytes"])
    # the disconnected requests were aborted at once: left to run, each would have generated at least
    # max_tokens / 2 = 8 tokens more after its client left (it leaves after 1 to 8 events)
    assert 0 <= soak["tokens_after_disconnects"] <= 4 * soak["disconnected"]


def test_check_responses_catches_a_wrong_text_or_finish_reason():
    refs = {1: {"text": " the list", "finish_reason": "length"}, 2: {"text": " a value", "finish_reason": "stop"}}

    def r(index, text, finish="length", **kw):
        return Response(index, 0.0, text=text, finish_reason=finish, **kw)

    good = check_responses([r(1, " the list"), r(2, " a value", "stop")], refs)
    assert good["compared"] == 2 and good["equal"] == 2 and good["correct"]
    bad = check_responses([r(1, " the list"), r(1, " the lost"), r(2, " a value", "length"),
                           r(2, " a", disconnected=True), r(1, "", error="HTTP 500")], refs)
    assert bad["compared"] == 3 and bad["equal"] == 1 and not bad["correct"]
    assert [m["common_chars"] for m in bad["mismatches"]] == [6, 8]
    assert not check_responses([r(1, "x", disconnected=True)], refs)["correct"]  # nothing compared: no pass


def test_verify_mismatches_replays_each_distinct_response_once():
    refs = {1: {"text": " a", "finish_reason": "length"}, 2: {"text": " b", "finish_reason": "length"}}

    class Fake:
        calls = []

        def check(self, prompt, text, finish, tokens):
            self.calls.append(text)
            return {"ok": text.startswith(" ok"), "ties": 1, "max_gap": 0.1, "failed_at": None if text.startswith(" ok") else 0}

    class P:
        def prompt(self, i):
            return f"p{i}"

    def r(index, text, **kw):
        return Response(index, 0.0, text=text, finish_reason="length", **kw)

    fake = Fake()
    out = bench_serve.verify_mismatches(fake, P(), [r(1, " a"), r(1, " ok1"), r(1, " ok1"), r(2, " bad"), r(2, " ok2"),
                                                    r(2, " x", disconnected=True)], refs, limit=10)
    assert sorted(fake.calls) == [" bad", " ok1", " ok2"]  # the equal one and the disconnected one are not replayed
    assert (out["greedy_up_to_ties"], out["wrong"], out["unverified"], out["replayed"]) == (3, 1, 0, 3)
    out = bench_serve.verify_mismatches(Fake(), P(), [r(1, " ok1"), r(2, " ok2"), r(2, " ok2")], refs, limit=1)
    assert (out["greedy_up_to_ties"], out["unverified"]) == (1, 2)


def test_statistics_and_exact_prompt_lengths():
    assert percentile([], 99) is None and percentile([3.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile(list(map(float, range(101))), 99) == 99.0
    assert bench_serve.union_length([(0, 1), (0.5, 2), (3, 4)]) == 3.0 and bench_serve.union_length([(0, 5), (1, 2)]) == 5.0
    from hybrid.cli import DEFAULT_CHECKPOINT
    from hybrid.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_CHECKPOINT)
    for n in (512, 2048):
        assert len(tok.encode(text_of_tokens(tok, n, seed=1))) == n
    prompts = bench_serve.make_prompts(tok, 512, 4, 1024)
    assert prompts.system_tokens == 512 and prompts.prefix_stable
    assert len(set(prompts.questions)) == 4


def test_greedy_verifier_accepts_greedy_paths_and_rejects_others(quick):
    """The soak's replay check on the quick run's checkpoint: the lone greedy response passes with no tie; a
    response that takes the runner-up at the closest call and goes on greedily passes exactly when the
    tolerance covers that gap; a changed word or another prompt's response fails."""
    _verifier_checks(quick[2])


def _verifier_checks(directory):
    import torch

    import hybrid
    from hybrid.generate import generate_ids

    model, tok = hybrid.load(directory, dtype="fp32", progress=False)
    prompts = bench_serve.make_prompts(tok, 512, 3, 1024)
    n = 12
    (ref,) = hybrid.generate(model, tok, [prompts.prompt(1)], max_new_tokens=n)
    assert ref.finish_reason == "length"
    verifier = bench_serve.GreedyVerifier(model, tok, prompts.system, tolerance=0.0)
    assert verifier.check(prompts.prompt(1), ref.text, "length", n) == {"ok": True, "ties": 0, "max_gap": 0.0,
                                                                         "failed_at": None}
    other = hybrid.generate(model, tok, [prompts.prompt(2)], max_new_tokens=n)[0].text
    assert not verifier.check(prompts.prompt(1), other, "length", n)["ok"]
    words = ref.text.split(" ")
    words[-2] = "zzz" if words[-2] != "zzz" else "qqq"
    assert not verifier.check(prompts.prompt(1), " ".join(words), "length", n)["ok"]

    ids = tok.encode(prompts.prompt(1))
    with torch.inference_mode():
        logits = model(torch.tensor([ids + ref.token_ids]))[0, len(ids) - 1:-1].float()
    top = logits.topk(2)
    gaps = (top.values[:, 0] - top.values[:, 1]) / logits.std(dim=-1)
    k = int(gaps[: n - 1].argmin())  # the closest call (not the last token: something follows it)
    runner_up = int(top.indices[k, 1])
    (rest,) = generate_ids(model, [ids + ref.token_ids[:k] + [runner_up]], max_new_tokens=n - k - 1)
    path = ref.token_ids[:k] + [runner_up] + rest.token_ids
    text = tok.decode(path)
    if text == ref.text or len(path) != n or any(t in tok.stop_ids for t in path):
        pytest.skip("the runner-up's path decodes like the reference (or stops): nothing to tell apart")
    gap = float(gaps[k])
    assert not bench_serve.GreedyVerifier(model, tok, prompts.system, gap * 0.9).check(prompts.prompt(1), text, "length", n)["ok"]
    v = bench_serve.GreedyVerifier(model, tok, prompts.system, gap * 1.1 + 1e-6).check(prompts.prompt(1), text, "length", n)
    assert v["ok"] and v["ties"] >= 1 and v["max_gap"] == pytest.approx(gap, rel=1e-3)
