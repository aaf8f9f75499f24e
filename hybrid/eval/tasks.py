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
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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


@dataclass
class Sample:
    """One task instance.

    prompt: context and question, ending where the answer starts.
    answers: the reference strings a prediction is scored against.
    continuation: the text a perfect model writes right after the prompt (used for training).
    """

    task: str
    prompt: str
    answers: list[str]
    continuation: str
    depth_percent: float | None = None
    meta: dict = field(default_factory=dict)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _insert_at_depth(units: list[str], needle: str, depth_percent: float) -> list[str]:
    """Insert `needle` between units so that `depth_percent` of the units come before it."""
    at = round(len(units) * depth_percent / 100)
    return units[:at] + [needle] + units[at:]


def passkey(rng: random.Random, n_units: int, depth_percent: float) -> Sample:
    """The passkey task with `n_units` filler blocks; the key is a 5-digit number."""
    key = _digits(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    units = _insert_at_depth([FILLER] * n_units, needle, depth_percent)
    prompt = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there. "
        + " ".join(units)
        + " What is the pass key? The pass key is"
    )
    return Sample("passkey", prompt, [key], f" {key}.", depth_percent)


def needle(rng: random.Random, n_units: int, depth_percent: float) -> Sample:
    """RULER niah_single_1 style: a word key and a 7-digit value in the filler haystack."""
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
    return Sample("needle", prompt, [value], f" {value}.", depth_percent)


def phonebook(rng: random.Random, n_units: int, depth_percent: float | None = None) -> Sample:
    """`n_units` distinct "First Last: 555-0123" lines; the queried entry sits at `depth_percent` (random if None)."""
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
    return Sample("phonebook", prompt, [numbers[at]], f" {numbers[at]}.", depth_percent)


def kv_recall(rng: random.Random, n_units: int, n_queries: int = 4) -> Sample:
    """Multi-query associative recall in text: `n_units` "word=number" pairs, then `n_queries` keys asked in
    turn; every answer but the last is given in the prompt, so the model is scored on the last one."""
    keys = [f"{a}-{w}" for a, w in rng.sample([(a, w) for a in ADJECTIVES for w in WORDS], n_units)]
    values = [_digits(rng, 3) for _ in keys]
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    asked = rng.sample(range(len(keys)), min(n_queries, len(keys)))
    queries = " ".join(f"{keys[i]}={values[i]}" for i in asked[:-1])
    last = asked[-1]
    prompt = f"Pairs: {pairs}\nLookups: {queries} {keys[last]}=".replace("  ", " ")
    return Sample("kv_recall", prompt, [values[last]], values[last])


GENERATORS = {"passkey": passkey, "needle": needle, "phonebook": phonebook, "kv_recall": kv_recall}


def fit_to_length(task: str, tokenizer, target_tokens: int, seed: int, depth_percent: float = 50.0,
                  **options) -> Sample:
    """The instance of `task` whose prompt is the longest not exceeding `target_tokens` tokens.

    The haystack grows in whole units, so the prompt is within one unit of the target. The sample is a
    pure function of (task, tokenizer, target_tokens, seed, depth_percent, options); `options` go to the
    generator (e.g. `n_queries` for kv_recall).
    """
    gen = GENERATORS[task]

    def make(n: int) -> Sample:
        rng = random.Random(f"{task}:{seed}:{depth_percent}")
        return gen(rng, n, **options) if task == "kv_recall" else gen(rng, n, depth_percent, **options)

    def length(n: int) -> int:
        return len(tokenizer.encode(make(n).prompt))

    lo, hi = 1, 2
    while length(hi) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if length(mid) <= target_tokens:
            lo = mid
        else:
            hi = mid
    sample = make(lo)
    sample.meta["units"] = lo
    sample.meta["prompt_tokens"] = length(lo)
    return sample
