"""Parts of an evaluation: (tasks, lengths, n) groups that share methods, budgets and settings, so that one
published evaluation can hold 2k-4k prompts on two tasks at n = 30 beside 8k prompts on one task at n = 20 (an 8k
example costs several shorter ones). No torch: the CLI builds these before anything heavy is imported."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError


@dataclass(frozen=True)
class EvalPart:
    """One group of an evaluation: every task at every length, ``n`` examples each."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if not self.tasks or not self.lengths:
            raise MoendError("an evaluation part needs at least one task and one length")
        check_int("n", self.n)

    def describe(self) -> str:
        return f"{', '.join(self.tasks)} at {', '.join(map(str, self.lengths))} tokens, n = {self.n}"


def describe_parts(parts: Sequence[EvalPart]) -> str:
    return "; ".join(p.describe() for p in parts)


def choose_parts(published: Sequence[EvalPart], *, tasks: Sequence[str] | None = None,
                 lengths: Sequence[int] | None = None, n: int | None = None) -> tuple[EvalPart, ...]:
    """The parts a command line asks for. Without ``lengths`` every published part runs, with ``tasks`` and ``n``
    replacing each part's where given; with ``lengths`` one part of those lengths runs, its tasks and n taken
    from the arguments or else from the first published part."""
    if not published:
        raise MoendError("no published evaluation parts to choose from")
    if lengths is not None:
        first = published[0]
        return (EvalPart(tuple(tasks) if tasks is not None else first.tasks, tuple(lengths),
                         n if n is not None else first.n),)
    over: dict[str, Any] = {}
    if tasks is not None:
        over["tasks"] = tuple(tasks)
    if n is not None:
        over["n"] = n
    return tuple(replace(p, **over) for p in published)
