"""A tiny model, its table and prefilled held-out text for the search tests (shared with the worker processes,
which rebuild the same model from its seed and load the table the parent saved)."""

from __future__ import annotations

import torch

from moend_fx.calibration.pipeline import calibrate
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.models import tiny_model
from moend_fx.plan.routing import Grid
from moend_fx.search import HeldOutText, MeasuredKL, Problem, SearchSettings

TINY = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
GRID = Grid((0.25, 0.5, 1.0), (16, 4, 2), (16, 4, 2))
TEXT = HeldOutText(search=2, check=2, tokens=160, continuation=16)


def model():
    torch.manual_seed(0)
    return tiny_model("llama", **TINY, seed=1)


def table(m) -> SensitivityTable:
    return calibrate(m, tokens=160, num_sequences=1, grid=GRID)


def settings(**kw) -> SearchSettings:
    return SearchSettings(**{"budget": "5x", "trials": 12, "radius": 2, "text": TEXT, **kw})


def objective(m, t, text: HeldOutText = TEXT) -> MeasuredKL:
    from moend_fx.search.objective import held_out_objectives

    search, _, _ = held_out_objectives(m, None, t, text, check=False)
    return search


def problem(t, s: SearchSettings) -> Problem:
    return Problem.of(t, s)
