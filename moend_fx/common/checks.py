"""Argument checks shared by every stage. Each raises the given :class:`MoendError` subclass with a message that
names the argument, the bad value and what is allowed."""

from __future__ import annotations

from typing import Any

from moend_fx.common.errors import MoendError

ALLOWED_BITS = (16, 8, 4)
"""Bit widths a K or V side may use: 16 = stored unquantized; 8 and 4 = packed codes."""


def check_int(name: str, value: Any, *, minimum: int = 1, error: type[MoendError] = MoendError) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise error(f"{name}={value!r} is invalid; allowed: {allowed}")
    return value


def check_power_of_two(name: str, value: Any, *, error: type[MoendError] = MoendError) -> int:
    """``value`` if it is a positive power-of-two int, else ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise error(f"{name}={value!r} is invalid; allowed: a power of two (e.g. 32)")
    return value


def check_bits(name: str, bits: Any, *, allowed: tuple[int, ...] = ALLOWED_BITS,
               error: type[MoendError] = MoendError) -> int:
    """``bits`` if it is one of ``allowed``, else ``error``."""
    if isinstance(bits, bool) or bits not in allowed:
        raise error(f"{name}={bits!r} is not a supported bit width; allowed: {list(allowed)}")
    return int(bits)


def check_choice(name: str, value: Any, allowed: Any, *, error: type[MoendError] = MoendError) -> Any:
    """``value`` if it is in ``allowed`` (a StrEnum class or a collection of names), else ``error``.

    For a StrEnum the member is returned, so callers hold the enum whether they were given a str or a member."""
    if isinstance(allowed, type) and isinstance(value, allowed):
        # already a member: returned as is, which is also what dynamo can trace (torch 2.11's cannot build the enum
        # from a constant inside a compiled decode step: "Unexpected type in sourceless builder")
        return value
    if isinstance(allowed, type) and isinstance(value, str):
        try:  # the enum's own value lookup: no list of names on hot paths (e.g. every kernel call)
            return allowed(value)
        except ValueError:
            pass
    names = [str(a) for a in allowed]
    if str(value) not in names or not isinstance(value, str):
        raise error(f"{name}={value!r} is unknown; allowed: {', '.join(names)}")
    return allowed(value) if isinstance(allowed, type) else value


def check_names(field: str, what: str, values: Any, allowed: Any, *, error: type[MoendError] = MoendError,
                unique: bool = False) -> tuple[str, ...]:
    """``values`` as a non-empty tuple whose every entry is in ``allowed`` (a registry or a StrEnum class), else
    ``error``; ``field`` names the argument, ``what`` one entry (e.g. "method"). ``unique``: no name twice."""
    values = tuple(values)
    if not values:
        raise error(f"{field} is empty; give at least one")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise error(f"{what} {bad[0]!r} is unknown; allowed: {', '.join(map(str, allowed))}")
    if unique and len(set(values)) != len(values):
        raise error(f"{field} {list(values)} repeat a name; give each once")
    return values
