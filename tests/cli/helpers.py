"""Shared helpers of the CLI tests: a table with calibrated statistics, the cells of a printed table."""

import dataclasses
import re

import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.stats_arrays import stats_to_arrays
from moend_fx.eviction.query_stats import QueryStats


def with_stats(table: SensitivityTable) -> SensitivityTable:
    """``table`` with calibrated trig query statistics on every layer (what `moend calibrate` stores)."""
    fp, g = table.fingerprint, torch.Generator().manual_seed(0)
    stats = {l: QueryStats.empty(fp.num_heads, fp.head_dim).accumulate(
        torch.randn(1, fp.num_heads, 5, fp.head_dim, generator=g)) for l in range(fp.num_layers)}
    return dataclasses.replace(table, query_stats=stats_to_arrays(stats))


def parse_rows(text: str, first: str) -> list[list[str]]:
    """The whitespace-split cells of the lines of ``text`` whose first cell matches ``first`` (a regex)."""
    rows = [line.split() for line in text.splitlines()]
    return [r for r in rows if r and re.fullmatch(first, r[0])]
