"""Synthetic long-context recall tasks, generated offline and deterministically from a seed.

Each generator returns a `Sample`: the prompt (context + question, ending with the answer prefix) and the
reference answers. The haystack is measured in repetitions of a unit (a filler sentence block, a
phonebook line, a key-value pair); `fit_to_length` picks the number of units so that the prompt has a
requested number of tokens under a given tokenizer.

- passkey (Mohtashami & Jaggi 2023): the filler block repeated, "The pass key is N. Remember it. N is the
  pass key." at a chosen depth; "What is the pass key? The pass key is".
- needle (RULER niah_single_1 on the "noise" haystack, Hsieh et al. 2024): "One of the special magic
  numbers for {key} is: {value}." at a chosen depth in the filler.
- phonebook (Jelassi et al. 2024): N "Name Surname: 555-0123" lines, then one name is queried.
- kv_recall (multi-query associative recall in text, after Zoology's MQAR): N "key=value" pairs of
  words and numbers, then several keys queried in turn.
- mqar (multi-query associative recall, Arora et al. 2023 "Zoology", arXiv:2312.04927): kv_recall's
  format with every pair queried; scored teacher-forced on every value, as Zoology scores MQAR.
- the RULER tasks of `hybrid.eval.ruler`, under the names of `RULER_TASKS`.

The prompts of passkey, needle, phonebook and kv_recall are what scripts/train.py trains on: keep them
byte for byte.
"""

from __future__ import annotations

import functools
import inspect
import random

from hybrid.eval import ruler
from hybrid.eval.sample import CapacityError, Sample, check_depth
from hybrid.eval.sample import digits as _digits
from hybrid.eval.sample import insert_at_depth as _insert_at_depth

__all__ = ["FILLER", "GENERATORS", "RULER_TASKS", "Sample", "build", "fit_to_length", "measured_text",
           "teacher_forced_pieces"]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

FIRST_NAMES = (
    "James Mary John Patricia Robert Jennifer Michael Linda William Elizabeth David Barbara Richard Susan Joseph "
    "Jessica Thomas Sarah Charles Karen Daniel Nancy Matthew Lisa Anthony Betty Mark Margaret Donald Sandra Steven "
    "Ashley Paul Kimberly Andrew Emily Joshua Donna Kenneth Michelle Kevin Dorothy Brian Carol George Amanda Edward "
    "Melissa Ronald Deborah Timothy Stephanie Jason Rebecca Jeffrey Sharon Ryan Laura Jacob Cynthia Gary Kathleen"
).split()
LAST_NAMES = (
    "Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Gonzalez Wilson "
    "Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris Sanchez Clark Ramirez Lewis Robinson "
    "Walker Young Allen King Wright Scott Torres Nguyen Hill Flores Green Adams Nelson Baker Hall Rivera Campbell "
    "Mitchell Carter Roberts Gomez Phillips Evans Turner Diaz Parker Cruz Edwards Collins Reyes Stewart Morris"
).split()
WORDS = (
    "apple river stone cloud tiger maple silver garden window candle forest harbor pepper violet rocket marble "
    "lantern meadow copper falcon orchid pebble thunder willow saddle bamboo cactus dolphin ember glacier hazel "
    "iris jasper kettle lemon mango nectar olive panda quartz raven sierra tulip umber velvet walnut yarrow zebra "
    "anchor beacon cobalt dune echo fern grove hollow ivory juniper kelp lotus mist nova onyx prism quill ridge"
).split()
ADJECTIVES = (
    "quick lazy bright dark silent loud gentle brave calm eager fierce happy jolly kind lucky merry noble proud "
    "quiet rapid shiny tidy vast warm young zesty bold clever daring early fancy giant humble icy jumpy keen"
).split()


def _require_depth(task: str, depth_percent: float | None) -> None:
    if depth_percent is None:
        raise ValueError(f"{task} needs a depth_percent in [0, 100], got None")
    check_depth(depth_percent)


def _depth_of(n_units: int, depth_percent: float) -> float:
    """Where `insert_at_depth` puts the needle: % of the units before it."""
    return 100.0 * round(n_units * depth_percent / 100) / n_units


def _check_pairs(n_units: int) -> None:
    if n_units > len(ADJECTIVES) * len(WORDS):
        raise CapacityError(f"kv_recall / mqar have {len(ADJECTIVES) * len(WORDS)} distinct keys, {n_units} asked")


def passkey(rng: random.Random, n_units: int, depth_percent: float) -> Sample:
    """The passkey task with `n_units` filler blocks; the key is a 5-digit number."""
    _require_depth("passkey", depth_percent)
    key = _digits(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    units = _insert_at_depth([FILLER] * n_units, needle, depth_percent)
    prompt = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there. "
        + " ".join(units)
        + " What is the pass key? The pass key is"
    )
    return Sample("passkey", prompt, [key], f" {key}.", depth_percent,
                  {"needle_depths": [_depth_of(n_units, depth_percent)]})


def needle(rng: random.Random, n_units: int, depth_percent: float) -> Sample:
    """RULER niah_single_1 style: a word key and a 7-digit value in the filler haystack."""
    _require_depth("needle", depth_percent)
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"
    value = _digits(rng, 7)
    units = _insert_at_depth([FILLER] * n_units, f"One of the special magic numbers for {key} is: {value}.", depth_percent)
    prompt = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
        + " ".join(units)
        + f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    return Sample("needle", prompt, [value], f" {value}.", depth_percent,
                  {"needle_depths": [_depth_of(n_units, depth_percent)]})


def phonebook(rng: random.Random, n_units: int, depth_percent: float | None = None) -> Sample:
    """`n_units` distinct "First Last: 555-0123" lines; the queried entry sits at `depth_percent` (random if None)."""
    if n_units > len(FIRST_NAMES) * len(LAST_NAMES):
        raise CapacityError(f"phonebook has {len(FIRST_NAMES) * len(LAST_NAMES)} distinct names, {n_units} asked")
    names: list[str] = []
    seen = set()
    while len(names) < n_units:
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    numbers = [f"{_digits(rng, 3)}-{_digits(rng, 4)}" for _ in names]
    at = rng.randrange(n_units) if depth_percent is None else min(n_units - 1, round((n_units - 1) * depth_percent / 100))
    lines = "\n".join(f"{n}: {p}" for n, p in zip(names, numbers))
    prompt = f"Phone book:\n{lines}\nWhat is the phone number of {names[at]}? The phone number of {names[at]} is"
    return Sample("phonebook", prompt, [numbers[at]], f" {numbers[at]}.", depth_percent,
                  {"needle_depths": [100.0 * at / n_units]})


def kv_recall(rng: random.Random, n_units: int, n_queries: int = 4) -> Sample:
    """Multi-query associative recall in text: `n_units` "word=number" pairs, then `n_queries` keys asked in
    turn; every answer but the last is given in the prompt, so the model is scored on the last one."""
    _check_pairs(n_units)
    keys = [f"{a}-{w}" for a, w in rng.sample([(a, w) for a in ADJECTIVES for w in WORDS], n_units)]
    values = [_digits(rng, 3) for _ in keys]
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    asked = rng.sample(range(len(keys)), min(n_queries, len(keys)))
    queries = " ".join(f"{keys[i]}={values[i]}" for i in asked[:-1])
    last = asked[-1]
    prompt = f"Pairs: {pairs}\nLookups: {queries} {keys[last]}=".replace("  ", " ")
    return Sample("kv_recall", prompt, [values[last]], values[last])


def mqar(rng: random.Random, n_units: int, n_queries: int | None = None) -> Sample:
    """Multi-query associative recall (Zoology's MQAR in text): kv_recall's `n_units` "word=number" pairs, then
    `n_queries` of the keys (all by default) queried in random order, each followed by its value.

    The prompt ends at "Lookups:"; the continuation " k=v k=v ..." is scored teacher-forced: every value
    is predicted from the pairs and the earlier (correct) lookups, as Zoology scores MQAR. `meta["pieces"]`
    holds the continuation as (text, is_answer) pieces.
    """
    _check_pairs(n_units)
    if n_queries is not None and n_queries < 1:
        raise ValueError(f"n_queries must be >= 1, got {n_queries}")
    keys = [f"{a}-{w}" for a, w in rng.sample([(a, w) for a in ADJECTIVES for w in WORDS], n_units)]
    values = [_digits(rng, 3) for _ in keys]
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    asked = rng.sample(range(n_units), n_units if n_queries is None else min(n_queries, n_units))
    pieces = [piece for i in asked for piece in ((f" {keys[i]}=", False), (values[i], True))]
    return Sample("mqar", f"Pairs: {pairs}\nLookups:", [values[i] for i in asked], "".join(t for t, _ in pieces),
                  None, {"pieces": pieces})


# RULER task name -> (generator, options). Names shared with RULER / lm-evaluation-harness have RULER's
# configuration (scripts/synthetic.yaml); the *_noise / *_needle ones are RULER's essay-haystack tasks
# (niah_multikey_1, niah_multivalue, niah_multiquery) on the haystacks that need no download.
RULER_TASKS = {
    "niah_single_1": (ruler.niah, dict(haystack="noise")),
    "niah_multikey_2": (ruler.niah, dict(haystack="needle")),
    "niah_multikey_3": (ruler.niah, dict(haystack="needle", key_type="uuids", value_type="uuids")),
    "niah_multikey_noise": (ruler.niah, dict(haystack="noise", num_keys=4)),
    "niah_multivalue_noise": (ruler.niah, dict(haystack="noise", num_values=4)),
    "niah_multivalue_needle": (ruler.niah, dict(haystack="needle", num_values=4)),
    "niah_multiquery_noise": (ruler.niah, dict(haystack="noise", num_queries=4)),
    "niah_multiquery_needle": (ruler.niah, dict(haystack="needle", num_queries=4)),
    "ruler_vt": (ruler.variable_tracking, {}),
    "ruler_cwe": (ruler.common_words, {}),
    "ruler_fwe": (ruler.freq_words, {}),
}

GENERATORS = {"passkey": passkey, "needle": needle, "phonebook": phonebook, "kv_recall": kv_recall, "mqar": mqar}
GENERATORS.update({name: functools.partial(fn, task=name, **opts) for name, (fn, opts) in RULER_TASKS.items()})


def build(task: str, n_units: int, seed: int, depth_percent: float | None = 50.0, target_tokens: int | None = None,
          **options) -> Sample:
    """The instance of `task` with `n_units` haystack units: a pure function of its arguments (the random
    generator is seeded from task, seed and depth). `target_tokens` reaches the generators that size
    themselves by it (RULER cwe / fwe); `options` go to the generator.

    Raises:
        ValueError: an unknown task; CapacityError (a ValueError) when the vocabulary cannot fill n_units.
    """
    if task not in GENERATORS:
        raise ValueError(f"task {task!r} is unknown; expected one of {sorted(GENERATORS)}")
    gen = GENERATORS[task]
    params = inspect.signature(gen).parameters
    if "target_tokens" in params and target_tokens is not None:
        options.setdefault("target_tokens", target_tokens)
    rng = random.Random(f"{task}:{seed}:{depth_percent}")
    return gen(rng, n_units, depth_percent, **options) if "depth_percent" in params else gen(rng, n_units, **options)


def measured_text(sample: Sample) -> str:
    """The text whose tokens count as the sample's length: the prompt, plus the continuation for
    teacher-forced tasks (samples with `meta["pieces"]`), whose whole sequence is context."""
    return sample.prompt + sample.continuation if "pieces" in sample.meta else sample.prompt


def fit_to_length(task: str, tokenizer, target_tokens: int, seed: int, depth_percent: float | None = 50.0,
                  **options) -> Sample:
    """The instance of `task` whose prompt is the longest not exceeding `target_tokens` tokens.

    The haystack grows in whole units, so the prompt is within one unit of the target: `build` with one
    unit more exceeds it (for teacher-forced tasks prompt and continuation together are measured, see
    `measured_text`). The sample is a pure function of (task, tokenizer, target_tokens, seed,
    depth_percent, options); `options` go to the generator (e.g. `n_queries` for kv_recall). `tokenizer`
    is anything whose `encode(text)` returns a sized sequence. When even one unit is too long, the
    one-unit sample is returned; `meta["prompt_tokens"]` says how long it is.

    Raises:
        ValueError: an unknown task, target_tokens < 1, or a task whose vocabulary runs out before the
            target (e.g. phonebook past 3,840 distinct names).
    """
    if task not in GENERATORS:
        raise ValueError(f"task {task!r} is unknown; expected one of {sorted(GENERATORS)}")
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be >= 1, got {target_tokens}")

    def make(n: int) -> Sample:
        return build(task, n, seed, depth_percent, target_tokens, **options)

    def length(n: int) -> int:
        return len(tokenizer.encode(measured_text(make(n))))

    capped: set[int] = set()

    def fits(n: int) -> bool:
        try:
            return length(n) <= target_tokens
        except CapacityError:
            capped.add(n)
            return False

    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if hi in capped:
        raise ValueError(f"task {task!r} cannot fill target_tokens={target_tokens}: its vocabulary allows at most "
                         f"{lo} units ({length(lo)} tokens)")
    sample = make(lo)
    sample.meta["units"] = lo
    sample.meta["prompt_tokens"] = length(lo)
    return sample


def teacher_forced_pieces(sample: Sample) -> list[tuple[str, bool]] | None:
    """The continuation of a teacher-forced sample as (text, is_answer) pieces, or None for generated tasks."""
    return sample.meta.get("pieces")
