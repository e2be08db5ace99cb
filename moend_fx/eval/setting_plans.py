"""What each setting of an evaluation compresses with: its sensitivity table, the plans solved on it, the
MoENDCache options (scorer, RoPE, the table's query statistics).

A run takes one table for every setting (as ``moend eval --table``) or one per setting (the default: each
setting's own table, calibrated with the scorer it compresses with, ``moend_fx.eviction.scorers.DEFAULT_SCORERS``),
so the query-aware rows score with the question's queries and the query-agnostic ones without.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.checks import check_choice
from moend_fx.common.errors import MoendError
from moend_fx.common.options import ScorerName, Setting
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import moend_options
from moend_fx.eval.plan_book import PlanBook


def table_scorer(table: SensitivityTable) -> str:
    """The scorer ``table`` was calibrated with (trig for tables that do not say)."""
    return str(table.calibration.get("scorer", ScorerName.TRIG))


@dataclass
class SettingPlans:
    """One setting's table, its plans (solved once per method, budget and length) and the cache options."""

    table: SensitivityTable
    plans: PlanBook
    moend_kw: dict[str, Any]
    scorer: str

    def summary(self, calibrated_stats: bool) -> dict[str, Any]:
        """JSON-ready: the table's calibration, the scorer and where its query statistics come from."""
        stats = "calibrated" if self.table.has_stats() and calibrated_stats else "estimated from the query window"
        return {"table": self.table.summary().get("calibration"), "scorer": self.scorer, "scorer_stats": stats}


def per_setting(tables: SensitivityTable | Mapping[str, SensitivityTable],
                settings: tuple[Setting, ...]) -> dict[Setting, SensitivityTable]:
    """``{setting: table}`` for every setting of a run: one table for all, or a mapping that names each."""
    if isinstance(tables, SensitivityTable):
        return {s: tables for s in settings}
    if not isinstance(tables, Mapping):
        raise MoendError(f"tables must be a SensitivityTable or a {{setting: table}} mapping; got "
                         f"{type(tables).__name__}")
    given = {check_choice("setting", k, Setting): v for k, v in tables.items()}
    missing = [str(s) for s in settings if s not in given]
    if missing:
        raise MoendError(f"no table for setting(s) {missing}; give one per setting of the run or one for all")
    for s, t in given.items():
        if not isinstance(t, SensitivityTable):
            raise MoendError(f"tables[{str(s)!r}] must be a SensitivityTable; got {type(t).__name__}")
    return {s: given[s] for s in settings}


def setting_plans(model: Any, tables: SensitivityTable | Mapping[str, SensitivityTable],
                  config: EvalConfig) -> dict[Setting, SettingPlans]:
    """A :class:`SettingPlans` per setting of ``config``; settings that share a table share its plans."""
    out: dict[Setting, SettingPlans] = {}
    built: dict[int, SettingPlans] = {}
    for setting, table in per_setting(tables, config.settings).items():
        table.check_model(model)
        if id(table) not in built:
            # plans budget the eviction state of the scorer the caches will use (an override keeps other state)
            scorer = config.scorer or table_scorer(table)
            plans = PlanBook(table.priced_for(scorer, table.has_stats() and config.calibrated_stats))
            extra = {} if config.scorer is None else {"scorer": config.scorer}
            kw = moend_options(model, table, window=config.window, calibrated_stats=config.calibrated_stats,
                               evict_every=config.evict_every, reevict=config.reevict,
                               budget_mode=config.budget_mode, **extra)
            built[id(table)] = SettingPlans(table, plans, kw, scorer)
        out[setting] = built[id(table)]
    return out
