"""RULER-style synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv:2404.06654; code: NVIDIA/RULER `scripts/data/synthetic/*.py` and
`scripts/eval/synthetic/constants.py`, also as lm-evaluation-harness `lm_eval/tasks/ruler`).

Templates, needle sentences, answer prefixes, key / value types and the insertion rules follow RULER; the
differences are stated where they occur: every random draw comes from the `rng` argument (RULER uses the
global `random` module), keys and values never collide with each other or with distractor keys, the word
lists are `hybrid.eval.vocab`'s, and the answer prefix is appended to the prompt without its trailing space.
Only the haystacks that need no download exist here: "noise" (RULER's "repeat": the filler sentence block
repeated) and "needle" (RULER's "needle": distractor needles with other keys). Essay haystacks are not
shipped.

Every generator is `gen(rng, n_units, depth_percent=None, **options) -> Sample`; `n_units` is the haystack
size (noise blocks, distractor needles, uncommon words or coded words), which `fit_to_length` searches
so the prompt has a requested number of tokens.
"""

from __future__ import annotations

import math
import random
import string

from hybrid.eval.sample import CapacityError, Sample, check_depth
from hybrid.eval.vocab import ADJECTIVES, NOUNS, distinct_words, random_value

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's spelling, kept so prompts match the published task.
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are:"
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the {num_common} most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top {num_common} words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

_KEY_CAPACITY = {"words": len(ADJECTIVES) * len(NOUNS), "numbers": 9 * 10**6, "uuids": 2**122}


def _positions(rng: random.Random, n_slots: int, k: int) -> list[int]:
    """k sorted insertion indexes in [0, n_slots): distinct when there is room (RULER's `random.sample`)."""
    if n_slots >= k:
        return sorted(rng.sample(range(n_slots), k))
    return sorted(rng.randrange(n_slots + 1) for _ in range(k))


def _merge(units: list[str], inserts: list[str], positions: list[int]) -> tuple[list[str], list[float]]:
    """`units` with inserts[i] placed before units[positions[i]] (positions sorted); also each insert's depth
    in % of the units before it."""
    out, depths, j = [], [], 0
    for i, unit in enumerate(units + [None]):
        while j < len(inserts) and positions[j] <= i:
            out.append(inserts[j])
            depths.append(100.0 * i / max(len(units), 1))
            j += 1
        if unit is not None:
            out.append(unit)
    return out, depths


class _Fresh:
    """Draws values of a kind that never repeat one already drawn through this object."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, kind: str) -> str:
        while True:
            value = random_value(self.rng, kind)
            if value not in self.used:
                self.used.add(value)
                return value


def niah(rng: random.Random, n_units: int, depth_percent: float | None = None, *, haystack: str = "noise",
         num_keys: int = 1, num_values: int = 1, num_queries: int = 1, key_type: str = "words",
         value_type: str = "numbers", task: str = "niah") -> Sample:
    """RULER needle-in-a-haystack (`niah.py`): `num_keys` keys, each with `num_values` needles
    "One of the special magic {numbers} for {key} is: {value}.", in a haystack of `n_units` units, then
    `num_queries` of the keys asked. The reference answers are all values of the queried keys.

    haystack: "noise" (n_units filler blocks) or "needle" (n_units distractor needles with other keys).
    depth_percent: with a single needle, the needle goes after that % of the units; otherwise (or when None)
        needles go to random unit boundaries, as RULER does.
    Units are joined with newlines, as in RULER.
    """
    if haystack not in ("noise", "needle"):
        raise ValueError(f"haystack must be 'noise' or 'needle', got {haystack!r}")
    for name, value in (("num_keys", num_keys), ("num_values", num_values), ("num_queries", num_queries)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    check_depth(depth_percent)
    num_keys = max(num_keys, num_queries)
    if haystack == "needle" and n_units + num_keys > _KEY_CAPACITY[key_type]:
        raise CapacityError(f"{n_units} distractor needles need more distinct {key_type} keys than exist")
    fresh = _Fresh(rng)
    keys, values, needles = [], [], []
    for _ in range(num_keys):
        keys.append(fresh(key_type))
        values.append([fresh(value_type) for _ in range(num_values)])
        needles += [NEEDLE.format(type_needle_v=value_type, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)

    if haystack == "noise":
        units = [FILLER] * n_units
    else:
        units = [NEEDLE.format(type_needle_v=value_type, key=fresh(key_type), value=random_value(rng, value_type))
                 for _ in range(n_units)]
    single = len(needles) == 1 and depth_percent is not None
    positions = [round(n_units * depth_percent / 100)] if single else _positions(rng, n_units, len(needles))
    sentences, depths = _merge(units, needles, positions)

    asked = rng.sample(range(num_keys), num_queries)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, type_v = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX, value_type
    if num_queries * num_values == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        type_v = type_v[:-1]
    prompt = template.format(type_needle_v=type_v, context="\n".join(sentences), query=query)
    return Sample(task, prompt, answers, " " + ", ".join(answers) + ".", depth_percent if single else None,
                  {"needle_depths": depths, "haystack": haystack})


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int,
               letters: int) -> tuple[list[list[str]], list[list[str]]]:
    """Variable names ([chain][hop], distinct, `letters` capitals) and the assignment statements."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chains_vars, chains = [], []
    for c in range(num_chains):
        v = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chains_vars.append(v)
        chains.append([f"VAR {v[0]} = {rng.randint(10000, 99999)}"]
                      + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(num_hops)])
    return chains_vars, chains


def variable_tracking(rng: random.Random, n_units: int, depth_percent: float | None = None, *, num_chains: int = 1,
                      num_hops: int = 4, icl: bool = True, icl_units: int = 3, letters: int = 5,
                      task: str = "ruler_vt") -> Sample:
    """RULER variable tracking (`variable_tracking.py`): chains `VAR X = 12345`, `VAR Y = VAR X`, ...
    (num_hops + 1 variables each) scattered in `n_units` noise blocks; the question asks for every variable
    that holds the first chain's value. With `icl` a solved example (3-letter names, `icl_units` blocks)
    comes first, as RULER's few-shot example. `depth_percent` is ignored (positions are random).
    """
    if num_chains < 1 or num_hops < 1:
        raise ValueError(f"num_chains and num_hops must be >= 1, got {num_chains} and {num_hops}")
    example = ""
    if icl:
        ex = variable_tracking(rng, icl_units, None, num_chains=num_chains, num_hops=min(10, num_hops), icl=False,
                               letters=3, task=task)
        example = ex.prompt + " " + " ".join(ex.answers) + "\n\n"
    chain_vars, chains = _vt_chains(rng, num_chains, num_hops, letters)
    sentences = [FILLER + "\n"] * n_units
    for chain in chains:
        positions = _positions(rng, len(sentences), len(chain))
        for j, (p, statement) in enumerate(zip(positions, chain)):
            sentences.insert(p + j, statement)
    context = " ".join(sentences).replace(". \n", ".\n")
    query = chains[0][0].split("=")[-1].strip()
    prompt = example + VT_TEMPLATE.format(context=context, query=query) + VT_ANSWER_PREFIX.format(
        num_v=num_hops + 1, query=query)
    return Sample(task, prompt, chain_vars[0], " " + " ".join(chain_vars[0]), None)


def _word_list(rng: random.Random, population: list[str], num_words: int, num_common: int, freq_common: int,
               freq_uncommon: int) -> tuple[str, list[str]]:
    """A numbered list "1. w 2. w ..." of `num_common` words repeated `freq_common` times and the other
    words `freq_uncommon` times, shuffled; and the common words."""
    words = rng.sample(population, num_words)
    common, uncommon = words[:num_common], words[num_common:]
    listing = common * freq_common + uncommon * freq_uncommon
    rng.shuffle(listing)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing)), common


def common_words(rng: random.Random, n_units: int, depth_percent: float | None = None, *, num_common: int = 10,
                 freq_common: int | None = None, freq_uncommon: int | None = None, icl: bool = True,
                 target_tokens: int | None = None, task: str = "ruler_cwe") -> Sample:
    """RULER common words extraction (`common_words_extraction.py`): a numbered list where `num_common` words
    appear `freq_common` times and `n_units` other words `freq_uncommon` times; name the common ones.

    Frequencies follow RULER: 30 / 3 for targets of 4096 tokens or more (or no target), 6 / 1 below; the
    solved example before the question has 40 words (10 / 3) or 20 words (3 / 1). Words come from
    `hybrid.eval.vocab.distinct_words`. `depth_percent` is ignored.
    """
    if num_common < 1:
        raise ValueError(f"num_common must be >= 1, got {num_common}")
    long = target_tokens is None or target_tokens >= 4096
    fc = freq_common if freq_common is not None else (30 if long else 6)
    fu = freq_uncommon if freq_uncommon is not None else (3 if long else 1)
    population = distinct_words(max(n_units + num_common, 686))
    example = ""
    if icl:
        ex_words, ex_fc, ex_fu = (40, 10, 3) if long else (20, 3, 1)
        ex_context, ex_common = _word_list(rng, population, max(ex_words, num_common + 1), num_common, ex_fc, ex_fu)
        example = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=ex_context, num_common=num_common) + " " + " ".join(
            f"{i + 1}. {w}" for i, w in enumerate(ex_common)) + "\n"
    context, common = _word_list(rng, population, n_units + num_common, num_common, fc, fu)
    prompt = example + (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=context, num_common=num_common)
    return Sample(task, prompt, common, " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common)), None)


def zeta(s: float) -> float:
    """The Riemann zeta function for s > 1 (Euler-Maclaurin after 1000 terms; relative error < 1e-12)."""
    if s <= 1:
        raise ValueError(f"zeta needs s > 1, got {s}")
    n = 1000
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def freq_words(rng: random.Random, n_units: int, depth_percent: float | None = None, *, coded_wordlen: int = 6,
               vocab_size: int | None = None, alpha: float = 2.0, target_tokens: int | None = None,
               task: str = "ruler_fwe") -> Sample:
    """RULER frequent words extraction (`freq_words_extraction.py`): `n_units` coded words (random
    `coded_wordlen`-letter strings) drawn from a Zipf law, word of rank k appearing
    int(n_units * k^-alpha / zeta(alpha)) times; rank 1 is "..." (noise); the answers are ranks 2..4.
    vocab_size defaults to target_tokens // 50 as in RULER (at least 10). `depth_percent` is ignored.
    """
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    size = vocab_size if vocab_size is not None else max(10, (target_tokens or 4096) // 50)
    if size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {size}")
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    z = zeta(alpha)
    words = [w for k, w in enumerate(ranked, start=1) for _ in range(int(n_units * k ** -alpha / z))]
    rng.shuffle(words)
    prompt = FWE_TEMPLATE.format(context=" ".join(words)) + FWE_ANSWER_PREFIX
    return Sample(task, prompt, ranked[1:4], " " + " ".join(ranked[1:4]), None)
