"""Solvers for MoE-nD routing: pick one compression config per layer under one KV-memory budget.

``get_solver(name, **options).solve(table, budget, context_length=T) -> SolveResult``; see ``docs/solvers.md``.
"""

from __future__ import annotations

from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.solvers.base import ArraySolution, Solver, SolveResult
from moend_fx.solvers.exact import ExactSolver
from moend_fx.solvers.greedy import GreedySolver
from moend_fx.solvers.optuna_search import OptunaSolver
from moend_fx.solvers.uniform import OneDSolver, PyramidSolver, TwoDSolver, TwoDUniformSolver

SOLVERS: dict[str, type[Solver]] = {
    cls.name: cls
    for cls in (GreedySolver, ExactSolver, OptunaSolver, OneDSolver, TwoDUniformSolver, TwoDSolver, PyramidSolver)
}


def get_solver(name: str, **options: Any) -> Solver:
    """A solver by name with its options (e.g. ``get_solver("optuna", n_trials=500, sampler="nsga2")``)."""
    if name not in SOLVERS:
        raise MoendError(f"solver {name!r} is unknown; allowed: {list(SOLVERS)}")
    try:
        return SOLVERS[name](**options)
    except TypeError as e:
        raise MoendError(f"solver {name!r}: bad option(s) {sorted(options)}: {e}") from None


__all__ = ["SOLVERS", "ArraySolution", "ExactSolver", "GreedySolver", "OneDSolver", "OptunaSolver",
           "PyramidSolver", "SolveResult", "Solver", "TwoDSolver", "TwoDUniformSolver", "get_solver"]
