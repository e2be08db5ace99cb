"""Retrieval tasks: passkey and the needle-in-a-haystack family (RULER's niah_* shapes).

Defaults are set for SmolLM2-135M: design.md measured passkey 20/20 but 4-needle NIAH only 6/20 on
the full cache, too hard to separate methods. So the multi-needle variants default to two needles,
short keys ("quiet-river") and an answer prefix that repeats the key and primes the format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from moend_fx.eval.tasks.base import Example, check_task, fill_haystack
from moend_fx.eval.tasks.text import key_phrase, random_number


@dataclass(frozen=True)
class PasskeyTask:
    """A random passkey hidden in filler; the classic repeated filler by default.

    The repeated "The grass is green..." filler matches the published passkey test and design.md's
    peer measurements; haystack="sentences" gives the harder diverse filler. The needle is the classic
    one without its reversed repeat ("... {key} is the pass key."), which the small model confused
    with the answer format.
    """

    name: ClassVar[str] = "passkey"
    digits: int = 5
    haystack: str = "repeat"

    def __post_init__(self) -> None:
        check_task("passkey", haystack=self.haystack, digits=self.digits)

    def build(self, tokenizer: Any, length: int, rng: random.Random, depth: float) -> Example:
        key = random_number(rng, self.digits, set())
        # The classic needle's second half ("... {key} is the pass key.") made SmolLM2-135M answer "the pass
        # key" instead of the number on 5/30 full-cache prompts: "is" is followed by " the" there, and a
        # copying head follows it. The one-sentence needle scores 29/30 on the same prompts.
        needle = f"The pass key is {key}. Remember it."
        intro = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about it afterwards.")

        def make(context: str) -> Example:
            return Example(
                task=self.name, intro=intro, context=context, question="What is the pass key?",
                answer_prefix="The pass key is", answers=(key,), match="number",
                meta={"depth": depth, "digits": self.digits},
            )

        return fill_haystack(tokenizer, length, rng, self.haystack, [(needle, depth)], make)


@dataclass(frozen=True)
class NiahTask:
    """Needles "One of the special magic numbers for {key} is: {value}." in an essay-like haystack.

    num_keys: needles with distinct keys (one is asked about, the rest are distractors at random
    depths). num_values: values of the asked key (all must be returned); the first sits at the
    requested depth, the others at random depths.
    """

    name: ClassVar[str] = "niah_single"
    num_keys: int = 1
    num_values: int = 1
    digits: int = 6
    haystack: str = "sentences"

    def __post_init__(self) -> None:
        check_task("niah", haystack=self.haystack, digits=self.digits, num_keys=self.num_keys,
                   num_values=self.num_values)

    def build(self, tokenizer: Any, length: int, rng: random.Random, depth: float) -> Example:
        keys: list[str] = []
        for _ in range(self.num_keys):
            keys.append(key_phrase(rng, set(keys)))
        used: set[str] = set()
        values = [random_number(rng, self.digits, used) for _ in range(self.num_values)]
        used.update(values)
        target = keys[0]
        needles = [(self._needle(target, values[0]), depth)]
        needles += [(self._needle(target, v), rng.random()) for v in values[1:]]
        for k in keys[1:]:
            v = random_number(rng, self.digits, used)
            used.add(v)
            needles.append((self._needle(k, v), rng.random()))
        plural = self.num_values > 1
        intro = ("Some special magic numbers are hidden within the following text. "
                 "Make sure to memorize them. I will quiz you about the numbers afterwards.")
        if plural:
            question = f"What are all the special magic numbers for {target} mentioned in the provided text?"
            prefix = f"The special magic numbers for {target} mentioned in the provided text are"
        else:
            question = f"What is the special magic number for {target} mentioned in the provided text?"
            prefix = f"The special magic number for {target} mentioned in the provided text is"

        def make(context: str) -> Example:
            return Example(
                task=self.name, intro=intro, context=context, question=question, answer_prefix=prefix,
                answers=tuple(values), match="number",
                meta={"depth": depth, "keys": keys, "num_keys": self.num_keys,
                      "num_values": self.num_values},
            )

        return fill_haystack(tokenizer, length, rng, self.haystack, needles, make)

    @staticmethod
    def _needle(key: str, value: str) -> str:
        return f"One of the special magic numbers for {key} is: {value}."


@dataclass(frozen=True)
class NiahMultikeyTask(NiahTask):
    """Two needles by default: the asked key plus one distractor key."""

    name: ClassVar[str] = "niah_multikey"
    num_keys: int = 2


@dataclass(frozen=True)
class NiahMultivalueTask(NiahTask):
    """One key with two values by default; both must be returned."""

    name: ClassVar[str] = "niah_multivalue"
    num_values: int = 2
