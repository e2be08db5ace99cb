"""Offline RULER-style long-context tasks: registry and batch generation.

    >>> exs = make_examples("passkey", tokenizer, length=2048, n=30, seed=0)
    >>> ids = tokenizer(exs[0].prefill_text("query_agnostic"))["input_ids"]   # prefill, compress
    >>> ...  feed exs[0].suffix_text("query_agnostic"), decode greedily  ...
    >>> score(exs[0], generated_text)  # in [0, 1]

Each task is a frozen dataclass config with `build(tokenizer, length, rng, depth) -> Example`.
Lengths are the full prompt's token count under the given tokenizer (at most `length`, within one
filler sentence or list item of it). Needle depths are spread evenly over [0, 1] unless given.
Each example's RNG is seeded from (task, seed, index), so example i is the same whatever n is.
"""

from __future__ import annotations

import random
from typing import Any

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.eval.tasks.aggregate import CommonWordsTask, VariableTrackingTask
from moend_fx.eval.tasks.base import SETTINGS, Example, candidates, score
from moend_fx.eval.tasks.retrieval import NiahMultikeyTask, NiahMultivalueTask, NiahTask, PasskeyTask
from moend_fx.eval.tasks.text import count_tokens

TASKS: dict[str, type] = {
    cls.name: cls
    for cls in (PasskeyTask, NiahTask, NiahMultikeyTask, NiahMultivalueTask, VariableTrackingTask,
                CommonWordsTask)
}

__all__ = ["SETTINGS", "TASKS", "Example", "candidates", "depths_for", "get_task", "make_examples", "score"]


def get_task(task: str | Any) -> Any:
    """The task config for a registry name (with its defaults), or a config passed through."""
    if not isinstance(task, str):
        if getattr(type(task), "name", None) not in TASKS:
            raise MoendError(f"task config {task!r} is not a registered task; allowed: {', '.join(TASKS)}")
        return task
    if task not in TASKS:
        raise MoendError(f"task {task!r} is unknown; allowed: {', '.join(TASKS)}")
    return TASKS[task]()


def depths_for(n: int, depth: float | None = None) -> list[float]:
    """`n` needle depths: all `depth` if given, else evenly spread over [0, 1] (0.5 for n=1)."""
    if depth is not None:
        if not 0.0 <= depth <= 1.0:
            raise MoendError(f"depth {depth} out of range; allowed: [0, 1]")
        return [float(depth)] * n
    if n == 1:
        return [0.5]
    return [i / (n - 1) for i in range(n)]


def make_examples(
    task: str | Any, tokenizer: Any, length: int, n: int, seed: int = 0, depth: float | None = None
) -> list[Example]:
    """`n` examples of `task` (a name in TASKS or a task config), each at most `length` tokens."""
    cfg = get_task(task)
    check_int("n", n)
    check_int("length", length)
    out = []
    for i, d in enumerate(depths_for(n, depth)):
        rng = random.Random(f"{cfg.name}|{seed}|{i}")  # str seeds hash with sha512: stable across runs
        ex = cfg.build(tokenizer, length, rng, d)
        ex.meta.update(seed=seed, index=i, target_length=length,
                       n_tokens=count_tokens(tokenizer, ex.prompt_full), config=repr(cfg))
        out.append(ex)
    return out

