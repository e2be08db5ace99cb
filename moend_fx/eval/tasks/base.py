"""The example record, its two prompt layouts, string-match scoring and the length fitter.

Every task builds an :class:`Example` whose full prompt is

    intro + "\\n\\n" + context + "\\n\\n" + question + "\\n" + answer_prefix

and splits it in two places, one per setting of design.md's evaluation protocol:

* ``query_aware``: prefill = intro + context + question; suffix = answer prefix. Compression
  happens after the question is in the cache (SnapKV's setting, the paper's LongBench protocol).
* ``query_agnostic``: prefill = intro + context; suffix = question + answer prefix. The context is
  compressed before the question arrives (kvpress's pipeline).

Both splits fall on a newline, so tokenizing the two halves apart gives the same tokens as
tokenizing the whole (checked against the real tokenizer in the slow test).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.errors import MoendError
from moend_fx.common.options import Setting
from moend_fx.eval.tasks.text import check_haystack, count_tokens, haystack_kind, haystack_sentences

SETTINGS: tuple[str, ...] = tuple(str(s) for s in Setting)  # the names, for CLI defaults and help texts
MAX_DIGITS = 12  # the longest number a task hides (digit runs are what a "number" answer is read from)
MATCH_KINDS = ("number", "variable", "word")


@dataclass(frozen=True)
class Example:
    """One generated task instance.

    answers: every string the model must produce (order free). match: how candidate answers are
    read out of a generation: "number" (digit runs), "variable" (5-letter upper-case names),
    "word" (lower-cased words that occur in the context). meta: seed, depth requested and measured
    (token fraction of the context before each needle), token count, task parameters.
    """

    task: str
    intro: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    match: str = "number"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("match", self.match, MATCH_KINDS)
        if not self.answers:
            raise MoendError(f"example of task {self.task!r} has no answers")

    @property
    def _head(self) -> str:
        return f"{self.intro}\n\n{self.context}" if self.intro else self.context

    @property
    def _query(self) -> str:
        return f"\n\n{self.question}\n"

    @property
    def prompt_full(self) -> str:
        """The whole prompt as one string (= prefill_text(s) + suffix_text(s) for either setting)."""
        return self._head + self._query + self.answer_prefix

    def prefill_text(self, setting: str) -> str:
        """The text prefilled (and then compressed) under `setting`."""
        setting = check_choice("setting", setting, Setting)
        return self._head + self._query if setting == Setting.QUERY_AWARE else self._head

    def suffix_text(self, setting: str) -> str:
        """The text fed after compression under `setting`, before greedy decoding starts."""
        setting = check_choice("setting", setting, Setting)
        return self.answer_prefix if setting == Setting.QUERY_AWARE else self._query + self.answer_prefix


def check_counts(**counts: int) -> None:
    """:class:`MoendError` unless every keyword (a task's count parameter) is a positive int."""
    for name, value in counts.items():
        check_int(name, value)


def check_digits(task: str, digits: int) -> None:
    """:class:`MoendError` unless ``digits`` (the length of the numbers ``task`` hides) is in 1..MAX_DIGITS."""
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
        raise MoendError(f"{task} digits {digits!r} out of range; allowed: 1..{MAX_DIGITS}")


def check_task(task: str, *, haystack: str, digits: int, **counts: int) -> None:
    """The checks every needle task shares: a known ``haystack``, ``digits`` in range, positive ``counts``."""
    check_haystack(haystack)
    check_counts(**counts)
    check_digits(task, digits)


_PATTERNS = {
    "number": re.compile(r"\d+"),
    "variable": re.compile(r"(?<![A-Za-z])[A-Z]{5}(?![A-Za-z])"),
    "word": re.compile(r"[A-Za-z]+"),
}


def candidates(example: Example, text: str) -> list[str]:
    """Distinct answer-shaped strings of `text`, in order of first appearance."""
    found = _PATTERNS[example.match].findall(text)
    if example.match == "word":
        vocab = {w.lower() for w in _PATTERNS["word"].findall(example.context)}
        found = [w.lower() for w in found if w.lower() in vocab]
    return list(dict.fromkeys(found))


def score(example: Example, generated: str, strict: bool = True) -> float:
    """Fraction in [0, 1] of the expected answers found in `generated` (the decoded continuation).

    strict (default): only the first len(answers) answer-shaped candidates count, so listing every
    number or word of the context earns nothing; a passkey scores 1 only if the first number
    produced is exactly its digits. strict=False is RULER's lenient rule: each answer counts if it
    occurs anywhere as a whole token (case-insensitive).
    """
    want = {a.lower() for a in example.answers}
    if strict:
        got = {c.lower() for c in candidates(example, generated)[: len(want)]}
        return len(want & got) / len(want)
    hits = sum(
        1 for a in want
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(a)}(?![A-Za-z0-9])", generated, flags=re.IGNORECASE)
    )
    return hits / len(want)


class Pool:
    """A lazily extended list drawn from an endless iterator (haystack sentences, words)."""

    def __init__(self, source) -> None:
        self._source = iter(source)
        self._items: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self._items) < n:
            self._items.append(next(self._source))
        return self._items[:n]


def insert_needles(filler: Sequence[str], needles: Sequence[tuple[str, float]]) -> tuple[str, list[int]]:
    """Join `filler` sentences with each needle placed at its depth fraction.

    needles: (text, depth in [0, 1]) pairs; needles at the same slot keep their given order.
    Returns the context and each needle's character offset in it (in the order given).
    """
    n = len(filler)
    slots = sorted(range(len(needles)), key=lambda j: (round(needles[j][1] * n), j))
    by_slot: dict[int, list[int]] = {}
    for j in slots:
        by_slot.setdefault(round(needles[j][1] * n), []).append(j)
    pieces: list[str] = []
    offsets = [0] * len(needles)
    pos = 0

    def add(piece: str) -> None:
        nonlocal pos
        if pieces:
            pos += 1  # the joining space
        pieces.append(piece)
        pos += len(piece)

    for i in range(n + 1):
        for j in by_slot.get(i, []):
            add(needles[j][0])
            offsets[j] = pos - len(needles[j][0])
        if i < n:
            add(filler[i])
    return " ".join(pieces), offsets


def fit_length(
    tokenizer: Any, length: int, build: Callable[[int], Example], hint: int
) -> tuple[int, Example]:
    """(m, build(m)) for the largest m whose full prompt has at most `length` tokens.

    build(m) must grow with m (m = filler sentences or extra list items). `hint` is a first guess
    at the answer. Raises MoendError when even build(0) is longer than `length`.
    """
    def size(m: int) -> int:
        return count_tokens(tokenizer, build(m).prompt_full)

    base = size(0)
    if base > length:
        raise MoendError(f"length {length} is too short: the task's fixed text alone takes {base} tokens")
    lo, hi = 0, max(1, hint)
    while size(hi) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo, build(lo)


def measure_depths(tokenizer: Any, example: Example, offsets: Sequence[int]) -> list[float]:
    """Token fraction of the context that precedes each character offset."""
    total = count_tokens(tokenizer, example.context)
    return [round(count_tokens(tokenizer, example.context[:o]) / max(total, 1), 4) for o in offsets]


def tokens_per_item(tokenizer: Any, items: Sequence[str]) -> float:
    """Mean tokens per item when the items are joined with spaces (for `fit_length`'s hint)."""
    return max(count_tokens(tokenizer, " ".join(items)) / max(len(items), 1), 1e-3)


def fill_haystack(tokenizer: Any, length: int, rng: random.Random, haystack: str, needles, make) -> Example:
    """Fit haystack sentences around `needles` [(text, depth)] so the prompt is `length` tokens.

    make(context) -> Example; the haystack kind used and the measured needle depths go into its meta.
    """
    pool = Pool(haystack_sentences(rng, haystack))
    hint = int(length / tokens_per_item(tokenizer, pool.take(20)))
    m, ex = fit_length(tokenizer, length, lambda k: make(insert_needles(pool.take(k), needles)[0]), hint)
    _, offsets = insert_needles(pool.take(m), needles)
    ex.meta.update(
        haystack=haystack_kind(haystack),
        needle_depths=measure_depths(tokenizer, ex, offsets),
        filler_sentences=m,
    )
    return ex
