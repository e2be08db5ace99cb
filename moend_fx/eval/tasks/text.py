"""Offline text for the task generators: token counting, seeded haystack sentences, word lists.

Nothing here downloads anything. The haystack is built from a fixed vocabulary of simple English
sentences drawn with a seeded RNG, so every example is reproducible and no two stretches of the
haystack are the same sentence repeated (a repeated filler lets an eviction method keep "one copy"
and cheat, and a small model copes badly with it). Digits never occur in haystack text, so a
number in the context is always a needle.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from moend_fx.common.checks import check_choice
from moend_fx.common.errors import MoendError

LICENSE_DIR = Path("/usr/share/common-licenses")
HAYSTACKS = ("sentences", "licenses", "repeat")

# Classic passkey filler (Mohtashami & Jaggi 2023; RULER's "noise" haystack).
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_SUBJECTS = (
    "The farmer", "A young girl", "The old teacher", "My neighbour", "The baker", "A tall sailor",
    "The doctor", "Her brother", "The painter", "A quiet student", "The mayor", "His aunt",
    "The gardener", "A tired driver", "The musician", "Our guide", "The fisherman", "A small boy",
    "The nurse", "The carpenter", "A kind woman", "The writer", "The shopkeeper", "Their cousin",
)
_VERBS = (
    "carried", "painted", "found", "cleaned", "sold", "borrowed", "repaired", "opened", "watched",
    "described", "packed", "moved", "counted", "hid", "shared", "measured", "wrapped", "admired",
    "lost", "collected", "ordered", "polished", "forgot", "noticed",
)
_OBJECTS = (
    "a wooden chair", "the blue kettle", "an old map", "a basket of apples", "the garden gate",
    "a heavy coat", "the kitchen clock", "a letter from home", "the red bicycle", "a jar of honey",
    "the broken lamp", "a pile of books", "the silver spoon", "a warm blanket", "the long ladder",
    "a box of candles", "the green umbrella", "a loaf of bread", "the brass key", "a paper kite",
    "the fishing net", "a pair of boots", "the wool scarf", "a bowl of soup",
)
_PLACES = (
    "near the river", "in the village square", "behind the barn", "at the train station",
    "on the hill", "inside the library", "by the harbour", "in the forest", "at the market",
    "under the bridge", "beside the church", "in the orchard", "on the beach", "at the bakery",
    "in the workshop", "along the road",
)
_TIMES = (
    "in the morning", "after lunch", "before dinner", "late at night", "on a rainy day",
    "during the winter", "at sunrise", "in the spring", "last summer", "on the weekend",
    "early in the autumn", "at noon",
)
_ADJECTIVES = (
    "calm", "bright", "cold", "busy", "quiet", "warm", "crowded", "peaceful", "windy", "pleasant",
    "gloomy", "lively", "dusty", "fresh", "noisy", "gentle",
)
_TEMPLATES = (
    "{S} {V} {O} {P}.",
    "{T}, {s} {V} {O}.",
    "{S} {V} {O} {T}.",
    "The weather {P} was {A} {T}.",
    "{S} said that the road {P} was {A}.",
    "Nobody knew why {s} {V} {O} {P}.",
    "{S} {V} {O}, and then {s2} {V2} {O2}.",
    "It was {A} {P} when {s} {V} {O}.",
    "{S} often walked {P} {T}.",
    "Everyone agreed that the day had been {A}.",
)

# Words for keys, variable-free lists and the common-words task: concrete, distinct, lower case.
WORDS = tuple(sorted({
    w for phrase in _OBJECTS + _PLACES for w in phrase.split() if len(w) > 3 and w.isalpha()
} | set(_ADJECTIVES) | {
    "apple", "river", "mountain", "window", "garden", "pencil", "candle", "forest", "bottle",
    "island", "rabbit", "violin", "pepper", "mirror", "ladder", "planet", "castle", "button",
    "carpet", "dragon", "feather", "guitar", "hammer", "jacket", "kitten", "lemon", "marble",
    "needle", "orange", "pillow", "rocket", "saddle", "tomato", "wallet", "anchor", "badge",
    "cactus", "desert", "engine", "falcon", "glove", "harbor", "igloo", "jungle", "kettle",
    "lantern", "meadow", "napkin", "oyster", "parrot", "quilt", "rooster", "salmon", "tunnel",
    "valley", "walnut", "yogurt", "zebra", "copper", "cotton", "sugar", "thunder", "pebble",
    "cloud", "shadow", "silver", "velvet", "winter", "autumn", "summer", "spring", "coffee",
    "tiger", "eagle", "whale", "spider", "turtle", "camel", "monkey", "donkey", "beaver",
    "cherry", "grape", "melon", "peach", "plum", "onion", "carrot", "potato", "radish",
}))

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens `tokenizer` gives `text`: `tokenizer(text)["input_ids"]`, else `.encode(text)`."""
    if callable(tokenizer):
        ids = tokenizer(text)["input_ids"]
        # A batched tokenizer call on one string may still return a nested list.
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return len(ids)
    if hasattr(tokenizer, "encode"):
        return len(tokenizer.encode(text))
    raise MoendError(f"tokenizer {type(tokenizer).__name__} has neither __call__ nor encode")


def _sentence(rng: random.Random) -> str:
    subj = rng.choice(_SUBJECTS)
    subj2 = rng.choice(_SUBJECTS)
    text = rng.choice(_TEMPLATES).format(
        S=subj, s=subj[0].lower() + subj[1:], s2=subj2[0].lower() + subj2[1:],
        V=rng.choice(_VERBS), V2=rng.choice(_VERBS), O=rng.choice(_OBJECTS), O2=rng.choice(_OBJECTS),
        P=rng.choice(_PLACES), T=rng.choice(_TIMES), A=rng.choice(_ADJECTIVES),
    )
    return text[0].upper() + text[1:]


def _license_sentences() -> list[str]:
    """Digit-free sentences of the Debian licence texts, in a fixed order; [] if not installed."""
    if not LICENSE_DIR.is_dir():
        return []
    out: list[str] = []
    for path in sorted(LICENSE_DIR.iterdir()):
        if not path.is_file():
            continue
        text = " ".join(path.read_text(errors="replace").split())
        for sent in re.split(r"(?<=[.!?])\s+", text):
            if 30 <= len(sent) <= 300 and not re.search(r"\d", sent):
                out.append(sent)
    return out


def check_haystack(haystack: str) -> None:
    """:class:`MoendError` unless ``haystack`` is one of :data:`HAYSTACKS`."""
    check_choice("haystack", haystack, HAYSTACKS, error=MoendError)


def haystack_sentences(rng: random.Random, kind: str = "sentences"):
    """Endless iterator of haystack sentences.

    kind: "sentences" (seeded simple English), "licenses" (the Debian licence texts from a seeded
    start, falling back to "sentences" when /usr/share/common-licenses is absent: the fallback is
    silent but callers record the kind actually used via `haystack_kind`), "repeat" (classic filler).
    """
    check_haystack(kind)
    if haystack_kind(kind) == "licenses":
        sents = _license_sentences()
        i = rng.randrange(len(sents))
        while True:
            yield sents[i % len(sents)]
            i += 1
    if kind == "repeat":
        # One filler sentence at a time, so lengths can be fitted to within a sentence.
        parts = re.split(r"(?<=\.) ", REPEAT_FILLER)
        i = 0
        while True:
            yield parts[i % len(parts)]
            i += 1
    while True:
        yield _sentence(rng)


def haystack_kind(kind: str) -> str:
    """The haystack actually used for `kind` (licences fall back to sentences when not installed)."""
    if kind == "licenses" and not _license_sentences():
        return "sentences"
    return kind


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word (consonant-vowel syllables), for lists longer than WORDS."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def distinct_words(rng: random.Random, n: int) -> list[str]:
    """`n` distinct lower-case words: real words first (shuffled), then made-up ones."""
    words = list(WORDS)
    rng.shuffle(words)
    out = words[:n]
    seen = set(out)
    while len(out) < n:
        w = pseudo_word(rng)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def key_phrase(rng: random.Random, avoid: set[str]) -> str:
    """A short needle key such as "quiet-river", not in `avoid`."""
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(WORDS)}"
        if key not in avoid and key.split("-")[0] != key.split("-")[1]:
            return key


def random_number(rng: random.Random, digits: int, avoid: set[str]) -> str:
    """A `digits`-digit decimal string with no leading zero, not in `avoid`."""
    while True:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in avoid:
            return value
