"""Task generators of hybrid.eval: depth, length fitting, determinism, the RULER answers recomputed from the
prompts themselves, and the trained tasks' prompts pinned byte for byte."""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter

import pytest

from hybrid.eval import ruler, tasks
from hybrid.eval.registry import GROUPS, TASKS, expand_tasks
from hybrid.eval.tasks import FILLER, build, fit_to_length
from hybrid.tokenizer import Tokenizer
from tiny_checkpoint import write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tests' small byte-level BPE (vocab 320): many tokens per word, so lengths are tested finely."""
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer(directory)
    return Tokenizer.from_dir(directory)


class CharCounter:
    """One token per 4 characters (what scripts/train.py uses to size tasks before its tokenizer exists)."""

    def encode(self, text):
        return text[::4]


# sha256 (first 16 hex) of prompt | answers | continuation for fit_to_length(task, CharCounter(), 300, 3, 25.0),
# recorded from the module as scripts/train.py first used it: these prompts are training data.
PINNED = {
    "passkey": ("fd2bc04aac05fbc4", 10, 286),
    "needle": ("62b2409bb3269155", 9, 291),
    "phonebook": ("3d10f138b51cc124", 45, 298),
    "kv_recall": ("d55f12c62d3961dc", 68, 299),
}


@pytest.mark.parametrize("task", sorted(PINNED))
def test_trained_task_prompts_unchanged(task):
    s = fit_to_length(task, CharCounter(), 300, 3, 25.0)
    digest = hashlib.sha256((s.prompt + "|" + "|".join(s.answers) + "|" + s.continuation).encode()).hexdigest()[:16]
    assert (digest, s.meta["units"], s.meta["prompt_tokens"]) == PINNED[task]


@pytest.mark.parametrize("task,depth", [(t, d) for t in ("passkey", "needle", "niah_single_1")
                                        for d in (0.0, 30.0, 72.5, 100.0)])
def test_needle_sits_at_requested_depth_in_noise(tok, task, depth):
    s = fit_to_length(task, tok, 900, seed=5, depth_percent=depth)
    n = s.meta["units"]
    value = s.answers[0]
    needle_at = s.prompt.index(value)  # the needle sentence is the first place the value occurs
    before = s.prompt[:needle_at].count(FILLER)
    assert s.prompt.count(FILLER) == n
    assert before == round(n * depth / 100)
    assert abs(100 * before / n - depth) <= 100 / n / 2 + 1e-9  # within half a unit of the requested depth
    assert s.meta["needle_depths"] == [pytest.approx(100 * before / n)]


@pytest.mark.parametrize("depth", [0.0, 40.0, 100.0])
def test_needle_sits_at_requested_depth_among_distractors(tok, depth):
    s = fit_to_length("niah_multikey_2", tok, 1200, seed=2, depth_percent=depth)
    n = s.meta["units"]
    lines = s.prompt.split("\n")
    needles = [i for i, line in enumerate(lines) if line.startswith("One of the special magic numbers for")]
    assert len(needles) == n + 1
    true_line = next(i for i in needles if s.answers[0] in lines[i])
    assert needles.index(true_line) == round(n * depth / 100)


@pytest.mark.parametrize("depth", [0.0, 50.0, 100.0])
def test_phonebook_queried_entry_at_depth(tok, depth):
    s = fit_to_length("phonebook", tok, 800, seed=1, depth_percent=depth)
    lines = s.prompt.split("\n")[1:-1]
    assert len(lines) == s.meta["units"]
    index = next(i for i, line in enumerate(lines) if line.endswith(s.answers[0]))
    assert index == min(len(lines) - 1, round((len(lines) - 1) * depth / 100))


def _depth(task):
    return 50.0 if TASKS[task].uses_depth else None


@pytest.mark.parametrize("task", sorted(tasks.GENERATORS))
def test_fit_to_length_is_within_one_unit(tok, task):
    target = 1500 if task != "ruler_cwe" else 2500
    s = fit_to_length(task, tok, target, seed=3, depth_percent=_depth(task))
    n = s.meta["units"]
    measured = len(tok.encode(tasks.measured_text(s)))
    assert measured == s.meta["prompt_tokens"] <= target
    one_more = build(task, n + 1, 3, _depth(task), target)
    assert len(tok.encode(tasks.measured_text(one_more))) > target
    assert s.prompt == build(task, n, 3, _depth(task), target).prompt


@pytest.mark.parametrize("task", sorted(tasks.GENERATORS))
def test_same_seed_same_prompt(tok, task):
    a = fit_to_length(task, tok, 1200, seed=11, depth_percent=_depth(task))
    b = fit_to_length(task, tok, 1200, seed=11, depth_percent=_depth(task))
    c = fit_to_length(task, tok, 1200, seed=12, depth_percent=_depth(task))
    assert (a.prompt, a.answers, a.meta) == (b.prompt, b.answers, b.meta)
    assert a.prompt != c.prompt


def test_niah_templates_and_answers():
    rng = lambda: tasks.random.Random(0)  # noqa: E731
    single = ruler.niah(rng(), 20, 50.0)
    assert single.prompt.startswith("A special magic number is hidden within the following text.")
    key = single.prompt.split("What is the special magic number for ")[1].split(" mentioned")[0]
    assert single.prompt.endswith(f"mentioned in the provided text? The special magic number for {key} mentioned "
                                  "in the provided text is")
    assert f"One of the special magic numbers for {key} is: {single.answers[0]}." in single.prompt
    assert re.fullmatch(r"\d{7}", single.answers[0])
    multi = ruler.niah(rng(), 20, None, num_queries=4)
    assert multi.prompt.startswith("Some special magic numbers are hidden")
    assert multi.prompt.rstrip().endswith("mentioned in the provided text are") and ", and " in multi.prompt
    assert len(multi.answers) == 4 and all(multi.prompt.count(a) == 1 for a in multi.answers)
    values = ruler.niah(rng(), 20, None, num_values=4, haystack="needle")
    key = values.prompt.split("What are all the special magic numbers for ")[1].split(" mentioned")[0]
    found = re.findall(rf"One of the special magic numbers for {re.escape(key)} is: (\d+)\.", values.prompt)
    assert sorted(found) == sorted(values.answers) and len(found) == 4
    uuids = ruler.niah(rng(), 20, None, haystack="needle", key_type="uuids", value_type="uuids")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuids.answers[0])
    assert "A special magic uuid is hidden" in uuids.prompt


def test_needle_haystack_key_is_unique():
    s = ruler.niah(tasks.random.Random(3), 3000, 10.0, haystack="needle")
    key = s.prompt.split("What is the special magic number for ")[1].split(" mentioned")[0]
    assert len(re.findall(rf"for {re.escape(key)} is:", s.prompt)) == 1


def test_variable_tracking_answer_follows_the_chain():
    s = fit_to_length("ruler_vt", CharCounter(), 3000, seed=4, depth_percent=None)
    body = s.prompt.split("\n\n", 1)[1]  # after the solved example
    body = body[body.index("Memorize"):]
    query = re.search(r"assigned the value (\d+) in the text", body).group(1)
    assigned = {}
    for name, value in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", body):
        assigned[name] = value
    holders, changed = {n for n, v in assigned.items() if v == query}, True
    while changed:
        new = {n for n, v in assigned.items() if v.startswith("VAR ") and v[4:] in holders}
        changed = not new <= holders
        holders |= new
    assert holders == set(s.answers) and len(s.answers) == 5
    assert "variables are assgined the value" in s.prompt and s.prompt.endswith("they are:")


def test_common_words_answers_are_the_most_frequent():
    for target, freq_common, freq_uncommon in ((2000, 6, 1), (6000, 30, 3)):
        s = fit_to_length("ruler_cwe", CharCounter(), target, seed=1, depth_percent=None)
        listing = s.prompt.rsplit("Question:", 1)[0].rsplit("most often.\n", 1)[1]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", listing))
        assert {w for w, c in counts.items() if c == freq_common} == set(s.answers)
        assert set(counts.values()) == {freq_common, freq_uncommon}
        assert len(s.answers) == 10


def test_freq_words_answers_are_ranks_two_to_four():
    s = ruler.freq_words(tasks.random.Random(0), 3000, target_tokens=8000)
    context = s.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    ranked = [w for w, _ in Counter(context.split()).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers


def test_zeta_two_is_pi_squared_over_six():
    assert ruler.zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-12)
    assert ruler.zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-12)


def test_mqar_continuation_values_match_pairs():
    s = tasks.mqar(tasks.random.Random(0), 30)
    pairs = dict(re.findall(r"([a-z]+-[a-z]+)=(\d+)", s.prompt))
    assert "".join(t for t, _ in s.meta["pieces"]) == s.continuation
    queried = re.findall(r" ([a-z]+-[a-z]+)=", s.continuation)
    assert sorted(queried) == sorted(pairs)
    assert s.answers == [pairs[k] for k in queried]
    assert [t for t, is_answer in s.meta["pieces"] if is_answer] == s.answers


def test_errors_name_the_argument(tok):
    with pytest.raises(ValueError, match="task 'nope' is unknown"):
        fit_to_length("nope", tok, 100, 0)
    with pytest.raises(ValueError, match="target_tokens must be >= 1"):
        fit_to_length("passkey", tok, 0, 0)
    with pytest.raises(ValueError, match="cannot fill target_tokens"):
        fit_to_length("phonebook", CharCounter(), 60_000, 0)
    with pytest.raises(ValueError, match="haystack must be"):
        ruler.niah(tasks.random.Random(0), 5, haystack="essay")
    with pytest.raises(ValueError, match="depth_percent must be in"):
        ruler.niah(tasks.random.Random(0), 5, 120.0)
    with pytest.raises(ValueError, match="passkey needs a depth_percent"):
        fit_to_length("passkey", tok, 300, 0, None)


def test_groups_expand_to_known_tasks():
    assert expand_tasks(["passkey", "ruler", "passkey"])[:2] == ["passkey", "niah_single_1"]
    assert set(GROUPS["all"]) == set(TASKS) == set(tasks.GENERATORS)
    with pytest.raises(ValueError, match="task 'x' is unknown"):
        expand_tasks(["x"])
