"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse


def positive_int(s: str) -> int:
    """argparse type: an integer > 0 (argparse turns the error into a one-line usage error, exit code 2)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v
