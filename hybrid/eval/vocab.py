"""Word lists and random values for the RULER-style tasks, shipped in the package (nothing is downloaded).

RULER (Hsieh et al. 2024, NVIDIA/RULER `scripts/data/synthetic/niah.py`) draws needle keys as
`adjective-noun` pairs from the `wonderwords` lists, values as 7-digit numbers or UUIDs, and the common
words of `common_words_extraction` from wonderwords' nouns, adjectives and verbs. These lists are smaller
hand-written stand-ins (so prompts do not depend on an optional package's version): 181 adjectives x 280
nouns give 50,680 distinct keys, enough for distractor haystacks of about a million tokens.
"""

from __future__ import annotations

import random
import uuid

ADJECTIVES = tuple((
    "able acid angry ancient ashy awful bad basic better big bitter black blue bold boring brave brief bright "
    "broad broken brown busy calm careful cheap chilly clean clear clever close cloudy cold cool crazy creamy "
    "curly cute damp dark dead deep dizzy dry dull dusty eager early easy empty equal exact faint fair false "
    "famous fancy fast fat fierce flat fresh full funny fuzzy gentle giant glad golden good grand gray great "
    "green grumpy hard heavy helpful high hollow honest huge humble icy jolly juicy keen kind large late lazy "
    "light little lively long loose loud lucky mad massive merry mighty modern narrow nasty neat new nice noble "
    "noisy odd old orange pale plain polite poor proud purple quick quiet rapid rare raw red rich ripe rough "
    "round royal rude rusty sad safe salty sharp shiny short shy silent silly simple slim slow small smooth soft "
    "solid sour spicy steep sticky stiff strange strong sunny sweet swift tall tame tender thick thin tidy tiny "
    "tough ugly upset vast violet warm weak wet white wide wild wise witty wooden yellow young zany"
).split())

NOUNS = tuple((
    "actor airport anchor animal answer apple arch arrow artist aunt baby badge bag baker ball balloon band bank "
    "barn basket bath beach bean bear bed bee bell bench berry bike bird blade blanket boat bone book boot bottle "
    "box brain branch bread brick bridge brother brush bubble bucket button cabin cable cake camera camp candle "
    "canoe car card carpet castle cat cave chain chair chalk cheese cherry chicken church circle city clock cloud "
    "coat coin comet cook corn cotton cow crab crayon crown cup curtain dance desk diamond dinner doctor dog doll "
    "donkey door dragon drawer dream drum duck eagle earth egg elbow engine eye face farm feather fence field "
    "finger fire fish flag flower flute fog forest fork fox frog fruit garden gate ghost gift glass glove goat "
    "gold grape grass guitar hammer harbor hat hawk heart hill horse house ice island jacket jam jar jelly jewel "
    "judge kettle key king kite kitten knee knife ladder lake lamp leaf lemon letter library lion lizard lock "
    "map market meadow melon mirror monkey moon motor mountain mouse mud nail needle nest net night nose ocean "
    "onion orange owl paint palace pan paper parrot peach pear pencil pepper piano pig pillow pipe planet plant "
    "plate pocket pond potato puppy queen rabbit radio rain river road robot rock roof rope rose sail salt sand "
    "school sea seed shadow sheep shell ship shoe shop silver sink skirt sky snake snow soap sock spoon spring "
    "square star stone storm street sugar sun swan table tail teacher tent thread tiger toast tomato tooth towel "
    "tower town toy train tree truck tunnel turtle umbrella valley vase wagon wall whale wheel window wing wolf "
    "wood worm yard zebra"
).split())

VERBS = tuple((
    "accept add admire agree allow answer appear argue arrive ask bake balance bang bathe beg behave believe "
    "belong blink boil borrow bounce breathe bring brush build bump burn bury buzz calculate call carry catch "
    "change chase cheer chew clap climb close collect comb count cover crawl cross cry cycle dance decide "
    "deliver describe destroy dig divide drag dream drink drive drop earn eat enjoy enter escape explain fetch "
    "fill find fix float fly fold follow forgive gather glow grab greet grin grow guard guess hang happen help "
    "hide hop hover hug hunt hurry imagine invent itch jog join joke juggle jump kick kneel knit knock laugh "
    "launch learn lick lift listen look march melt mend mix move nod note obey offer open order pack paddle "
    "paint park pass pedal peel pick plant play point polish pour pray preach press print pull punch push "
    "race rain reach read relax remember repair rescue rest return rhyme ride ring rinse roll rub run rush "
    "sail scream search settle shake share shiver shop shout sing sip skate skip sleep slide smile sneeze "
    "sniff snore spell spill spin splash spray squeeze stamp stare start stay steer step stir stretch stroll "
    "suggest swim swing talk taste teach tickle tie trace travel trust tug twirl type unlock untie vanish visit "
    "wade wait walk wander wash watch wave weigh whisper whistle wiggle wink wish wobble wonder work worry "
    "wrap write yawn yell zip zoom"
).split())

# Distinct words for common-word extraction: real words first, then adjective+noun compounds when more
# are needed (long contexts need thousands of distinct words).
COMMON_WORDS = tuple(dict.fromkeys(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))))


def word_key(rng: random.Random) -> str:
    """An `adjective-noun` key, as RULER's `generate_random_word`."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def number(rng: random.Random, digits: int = 7) -> str:
    """A `digits`-digit number without a leading zero (RULER's `generate_random_number`)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid4(rng: random.Random) -> str:
    """A version-4 UUID drawn from `rng` (RULER's `generate_random_uuid`)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(rng: random.Random, kind: str) -> str:
    """A key or value of `kind`: "words", "numbers" or "uuids" (RULER's `type_needle_k` / `type_needle_v`)."""
    if kind == "words":
        return word_key(rng)
    if kind == "numbers":
        return number(rng)
    if kind == "uuids":
        return uuid4(rng)
    raise ValueError(f"kind must be 'words', 'numbers' or 'uuids', got {kind!r}")


def distinct_words(count: int) -> list[str]:
    """The first `count` words of `COMMON_WORDS` followed by `adjective+noun` compounds (deterministic)."""
    if count <= len(COMMON_WORDS):
        return list(COMMON_WORDS[:count])
    extra = (a + n for a in ADJECTIVES for n in NOUNS)
    words = list(COMMON_WORDS)
    seen = set(words)
    for w in extra:
        if len(words) >= count:
            break
        if w not in seen:
            seen.add(w)
            words.append(w)
    if len(words) < count:
        raise ValueError(f"count {count} exceeds the {len(words)} distinct words available")
    return words
