"""Argument types and parsing helpers shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from moend_fx.common.errors import MoendError


def positive_int(s: str) -> int:
    """argparse type: an integer > 0 (argparse turns the error into a one-line usage error, exit code 2)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: the comma lists every subcommand takes (empty items dropped)."""
    return [s.strip() for s in text.split(",") if s.strip()]


def int_list(text: str, what: str, example: str = "2048,4096") -> tuple[int, ...]:
    """A non-empty comma list of positive integers, else :class:`MoendError` naming the option ``what``."""
    try:
        vals = tuple(int(s) for s in csv_list(text))
    except ValueError:
        vals = ()
    if not vals or any(v <= 0 for v in vals):
        raise MoendError(f"{what}={text!r} is invalid; allowed: comma-separated positive integers (e.g. {example})")
    return vals


def names(options: Iterable[object]) -> list[str]:
    """Plain-string choices for argparse from a StrEnum or a registry (argparse would list enum reprs)."""
    return [str(o) for o in options]
