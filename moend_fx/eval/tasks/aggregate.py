"""Multi-hop and aggregation tasks: variable tracking and common-words extraction (RULER's vt, cwe)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from moend_fx.common.errors import MoendError
from moend_fx.eval.tasks.base import (
    Example,
    Pool,
    check_counts,
    check_task,
    fill_haystack,
    fit_length,
    tokens_per_item,
)
from moend_fx.eval.tasks.text import WORDS, distinct_words, pseudo_word, random_number


def _var_name(rng: random.Random, avoid: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in avoid:
            return name


@dataclass(frozen=True)
class VariableTrackingTask:
    """Chains "VAR A = 12345. ... VAR B = VAR A. ..."; return every variable holding the value.

    Chain 0 is asked about; chains 1.. are distractors with other values. Chain 0's statements sit
    in order across a window of width `spread` (a fraction of the context) that slides with the
    depth: depth 0 puts the window at the start, depth 1 at the end. Distractor windows are random.
    """

    name: ClassVar[str] = "variable_tracking"
    num_chains: int = 1
    num_hops: int = 2
    digits: int = 5
    spread: float = 0.3
    haystack: str = "sentences"

    def __post_init__(self) -> None:
        if not 0.0 <= self.spread <= 1.0:
            raise MoendError(f"spread {self.spread} out of range; allowed: [0, 1]")
        check_task("variable_tracking", haystack=self.haystack, digits=self.digits, num_chains=self.num_chains,
                   num_hops=self.num_hops)

    def build(self, tokenizer: Any, length: int, rng: random.Random, depth: float) -> Example:
        names: set[str] = set()
        values: set[str] = set()
        needles: list[tuple[str, float]] = []
        chains: list[list[str]] = []
        for c in range(self.num_chains):
            value = random_number(rng, self.digits, values)
            values.add(value)
            chain = []
            for _ in range(self.num_hops + 1):
                chain.append(_var_name(rng, names))
                names.add(chain[-1])
            chains.append(chain)
            start = (depth if c == 0 else rng.random()) * (1.0 - self.spread)
            for h, var in enumerate(chain):
                text = f"VAR {var} = {value}." if h == 0 else f"VAR {var} = VAR {chain[h - 1]}."
                needles.append((text, start + self.spread * h / self.num_hops))
            if c == 0:
                target_value = value
        answers = tuple(chains[0])
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        question = f"Find all variables that are assigned the value {target_value} in the text above."
        prefix = (f"According to the chain(s) of variables assigned in the text above, {len(answers)} "
                  f"variables are assigned the value {target_value}, they are:")

        def make(context: str) -> Example:
            return Example(
                task=self.name, intro=intro, context=context, question=question, answer_prefix=prefix,
                answers=answers, match="variable",
                meta={"depth": depth, "num_chains": self.num_chains, "num_hops": self.num_hops,
                      "value": target_value},
            )

        ex = fill_haystack(tokenizer, length, rng, self.haystack, needles, make)
        # The first statement of the asked chain marks the requested depth.
        ex.meta["chain_depths"] = ex.meta["needle_depths"][: self.num_hops + 1]
        return ex


@dataclass(frozen=True)
class CommonWordsTask:
    """A numbered word list in which `top_k` words occur `freq_common` times each and every other
    word at most `freq_uncommon` times; return the `top_k` most frequent. Length grows with the
    number of uncommon words. There is no needle, so the depth is ignored (meta depth None).
    """

    name: ClassVar[str] = "common_words"
    top_k: int = 5
    freq_common: int = 20
    freq_uncommon: int = 2

    def __post_init__(self) -> None:
        check_counts(top_k=self.top_k, freq_uncommon=self.freq_uncommon)
        if self.freq_common <= self.freq_uncommon:
            raise MoendError(
                f"freq_common {self.freq_common} must exceed freq_uncommon {self.freq_uncommon}")

    def build(self, tokenizer: Any, length: int, rng: random.Random, depth: float | None) -> Example:
        words = distinct_words(rng, self.top_k)
        common = tuple(words)
        # Uncommon words come from a lazily grown pool that never repeats a common word.
        word_rng = random.Random(rng.random())

        def more():
            taken = set(common)
            for w in distinct_words(word_rng, len(WORDS)):
                if w not in taken:
                    taken.add(w)
                    yield w
            while True:
                w = pseudo_word(word_rng)
                if w not in taken:
                    taken.add(w)
                    yield w

        pool = Pool(more())
        shuffle_seed = rng.random()
        intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.")
        question = f"What are the {self.top_k} most common words in the above list?"
        prefix = f"The top {self.top_k} words that appear most often in the list are:"

        def make(extra: int) -> Example:
            items = [w for w in common for _ in range(self.freq_common)]
            n_words = -(-extra // self.freq_uncommon)
            for i, w in enumerate(pool.take(n_words)):
                items += [w] * min(self.freq_uncommon, extra - i * self.freq_uncommon)
            random.Random(f"{shuffle_seed}|{extra}").shuffle(items)
            context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
            return Example(
                task=self.name, intro=intro, context=context, question=question, answer_prefix=prefix,
                answers=common, match="word",
                meta={"depth": None, "top_k": self.top_k, "freq_common": self.freq_common,
                      "freq_uncommon": self.freq_uncommon, "list_items": len(items)},
            )

        per_item = tokens_per_item(tokenizer, [f"{i + 100}. {w}" for i, w in enumerate(pool.take(20))])
        base = self.top_k * self.freq_common
        _, ex = fit_length(tokenizer, length, make, max(1, int(length / per_item) - base))
        return ex
