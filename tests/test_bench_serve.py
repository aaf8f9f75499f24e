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
    """`bench_serve.py --quick`, run in this process (its servers are processes of their own), with the
    correctness phase's reference of one prompt made wrong: the server's responses to it must then be
    counted as differing from it, and every other response as equal to its reference."""
    tmp = tmp_path_factory.mktemp("serve_bench")
    out = tmp / "serve_bench.json"
    original, calls = bench_serve.check_references, []

    def check_references(model, tokenizer, prompts, indices, max_tokens):
        refs = original(model, tokenizer, prompts, indices, max_tokens)
        calls.append(refs)
        first = min(refs)
        refs[first] = {**refs[first], "text": refs[first]["text"] + " (not what the model says)"}
        return refs

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(bench_serve, "check_references", check_references)
        code = bench_serve.main(["--quick", "--threads", "2", "--workdir", str(tmp / "work"), "--out", str(out)])
    assert code == 0 and len(calls) == 1 and len(calls[0]) == 8
    return json.loads(out.read_text()), stdout.getvalue(), min(calls[0])


def test_quick_levels_have_real_numbers(quick):
    report, stdout, _ = quick
    assert report["clients"] == [1, 4] and report["target_level"] == 4
    for clients in ("1", "4"):
        level = report["workloads"]["shared"]["ours"]["levels"][clients]
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


def test_quick_distinct_and_chat_workloads(quick):
    """Distinct prompts share nothing (no prefix hit); a chat's turns each extend the last, so every turn after the
    first resumes from the previous prompt's end (cached tokens at least its length)."""
    report, stdout, _ = quick
    turns = report["chat_turns"]
    for clients in ("1", "4"):
        distinct = report["workloads"]["distinct"]["ours"]["levels"][clients]
        assert distinct["errors"] == 0 and distinct["requests"] == 8 and distinct["cached_tokens"] == 0
        assert _positive(distinct["tok_s"]) and _positive(distinct["ttft_p99_s"])
        chat = report["workloads"]["chat"]["ours"]["levels"][clients]
        assert chat["errors"] == 0 and chat["requests"] == int(clients) * turns
        # turn 1 of each conversation is new, every later turn resumes at the last prompt's end
        assert chat["prefix_hits_per_admission"] == pytest.approx((turns - 1) / turns)
        assert chat["cached_tokens"] >= int(clients) * (turns - 1) * report["prompts"]["distinct_tokens"] * 0.9
    assert "distinct: about 128 tokens" in stdout and "chat: conversations of 2 turns" in stdout


def test_quick_long_prompt_and_targets(quick):
    report, stdout, _ = quick
    long, cost = report["long_prompt"], report["chunk_and_step"]
    assert long["long_prompt_tokens"] >= 1900 and long["itl_samples"] > 0 and _positive(long["itl_p99_s"])
    assert cost["chunks"] >= 3 and _positive(cost["chunk_max_s"]) and _positive(cost["decode_step_s"])
    names = [t["target"] for t in report["targets"]]
    assert any("batch-1 decode" in n for n in names) and any("sequential" in n for n in names)
    assert not any("TTFT" in n for n in names)  # TTFT is a ratio to the peer's, and --quick has no peer
    assert any("chunk + step" in n for n in names)
    ratio = next(t for t in report["targets"] if "sequential" in t["target"])
    shared = report["workloads"]["shared"]["ours"]["levels"]["4"]
    assert ratio["value"] == pytest.approx(shared["tok_s"] / report["sequential"]["tok_s"], rel=1e-2)
    assert "llama.cpp" not in report  # --quick leaves the peer out
    assert stdout.count("pass") + stdout.count("fall short") == len(report["targets"])


def test_quick_correctness_phase_compares_responses_and_frees_everything(quick):
    report, stdout, spoilt = quick
    check, soak = report["check"], report["soak"]
    assert check["dtype"] == soak["dtype"] == "fp32" and check["clients"] == 4 and check["requests"] == 8
    # 8 requests at once: all equal to their lone references but the one whose reference was spoilt
    assert check["compared"] == 8 and check["equal"] == 7 and not check["correct"]
    assert [m["prompt"] for m in check["mismatches"]] == [spoilt]
    assert soak["requests"] == 40 and soak["disconnected"] == 4 and soak["errors"] == 0
    assert soak["compared"] == 36  # every completed response was compared with its reference
    wrong = soak["compared"] - soak["equal"]  # the responses to the spoilt prompt (every 8th request), and only them
    assert 1 <= wrong <= 5 and {m["prompt"] for m in soak["mismatches"]} == {spoilt} and not soak["correct"]
    fraction = next(t for t in report["targets"] if t["target"].startswith("soak (fp32)"))
    assert fraction["value"] == pytest.approx(soak["equal"] / 36, abs=1e-3) and not fraction["pass"]
    assert f"prompt {spoilt} differs" in stdout
    assert report["workloads"]["shared"]["ours"]["levels"]["4"]["equal_to_reference"] == 8  # fp32: the lone ones
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


def test_statistics_and_exact_prompt_lengths():
    assert percentile([], 99) is None and percentile([3.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile(list(map(float, range(101))), 99) == 99.0
    assert bench_serve.union_length([(0, 1), (0.5, 2), (3, 4)]) == 3.0 and bench_serve.union_length([(0, 5), (1, 2)]) == 5.0
    r = Response(0, 0.0, events=[1.0, 2.0, 5.0, 5.5], event_tokens=[1, 1, 3, 1])
    assert r.token_gaps(0.0, 10.0) == [1.0, 1.0, 1.0, 1.0, 0.5]  # the 3-token event: 3 gaps of 1 s
    assert r.token_gaps(1.5, 5.0) == [1.0, 1.0, 1.0, 1.0] and r.gaps == [1.0, 3.0, 0.5]
    from hybrid.cli import DEFAULT_CHECKPOINT
    from hybrid.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_CHECKPOINT)
    for n in (512, 2048):
        assert len(tok.encode(text_of_tokens(tok, n, seed=1))) == n
    prompts = bench_serve.make_prompts(tok, 512, 4, 1024)
    assert prompts.system_tokens == 512 and prompts.prefix_stable
    assert len(set(prompts.questions)) == 4


def test_targets_against_the_peer_are_ratios_of_the_same_run():
    """At the target level of every workload: throughput and p99 TTFT as ratios to llama.cpp's server (distinct
    prompts: >= 1.5x and <= 0.5x; the others >= 1x and <= 1x); no absolute time is a target."""
    def level(tok_s, ttft):
        return {"tok_s": tok_s, "ttft_p99_s": ttft, "decode_tok_s": tok_s}

    report = {"target_level": 16, "sequential": {"tok_s": 10.0, "batch1_decode_tok_s": 20.0}, "workloads": {
        "shared": {"ours": {"levels": {"16": level(80.0, 1.0)}}, "llama.cpp": {"levels": {"16": level(20.0, 4.0)}}},
        "distinct": {"ours": {"levels": {"16": level(40.0, 3.0)}}, "llama.cpp": {"levels": {"16": level(32.0, 4.0)}}},
        "chat": {"ours": {"levels": {"16": level(30.0, 1.0)}}}}}
    got = {t["target"]: t for t in bench_serve.targets(report)}
    distinct = got["distinct, 16 clients: throughput / llama.cpp server's"]
    assert distinct["value"] == 1.25 and distinct["goal"] == 1.5 and not distinct["pass"]
    ttft = got["distinct, 16 clients: p99 TTFT / llama.cpp server's"]
    assert ttft["value"] == 0.75 and ttft["goal"] == 0.5 and ttft["below"] and not ttft["pass"]
    shared = got["shared, 16 clients: throughput / llama.cpp server's"]
    assert shared["value"] == 4.0 and shared["goal"] == 1.0 and shared["pass"]
    assert got["shared, 16 clients: throughput / sequential hybrid.generate"]["value"] == 8.0
    assert not any(name.startswith("chat") for name in got)  # no peer figures for it: nothing to compare
    assert not any("(s)" in name for name in got)
