"""The routing plan as data: one :class:`LayerConfig` per layer, the grid they come from and the model they fit.

A :class:`RoutingPlan` is a frozen value that serialises to versioned JSON (see ``docs/plan-format.md``).
Loading validates every field and names the field, the bad value and what is allowed.

The parts live in their own modules (``config``: :class:`LayerConfig`; ``grid``: :class:`Grid`;
``fingerprint``: :class:`ModelFingerprint`) and are re-exported here, so
``from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan`` keeps working.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moend_fx.common.checks import check_choice, check_int, check_power_of_two
from moend_fx.common.defaults import GROUP_SIZE, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import PlanError
from moend_fx.common.io import atomic_write_text, read_existing
from moend_fx.common.options import ScorerName
from moend_fx.plan.config import ALLOWED_BITS, LayerConfig, check_keep_ratio, check_plan_bits
from moend_fx.plan.fingerprint import ModelFingerprint
from moend_fx.plan.grid import PAPER_BITS, PAPER_KEEP_RATIOS, Grid
from moend_fx.plan.memory import plan_layer_bytes

PLAN_FORMAT = "moend_fx.plan.routing"
PLAN_FORMAT_VERSION = 1
ALLOWED_SCORERS: tuple[str, ...] = tuple(str(s) for s in ScorerName)
"""The scorer names a plan may carry (plain strings, derived from :class:`ScorerName`)."""

__all__ = ["ALLOWED_BITS", "ALLOWED_SCORERS", "PAPER_BITS", "PAPER_KEEP_RATIOS", "PLAN_FORMAT_VERSION", "Grid",
           "LayerConfig", "ModelFingerprint", "RoutingPlan", "check_keep_ratio", "check_plan_bits"]


@dataclass(frozen=True)
class RoutingPlan:
    """One :class:`LayerConfig` per layer, with the budget and context it was solved for.

    ``budget_bytes`` and ``context_length`` are what the solver targeted; ``bytes_planned`` is what the
    memory model says the plan takes at ``context_length`` tokens (batch 1). ``scorer`` is stored as a plain
    string (one of :class:`ScorerName`), so the plan's repr and JSON read the same whatever it was given.
    """

    layers: tuple[LayerConfig, ...]
    fingerprint: ModelFingerprint
    budget_bytes: int
    context_length: int
    grid: Grid = field(default_factory=Grid)
    group_size: int = GROUP_SIZE
    scorer: str = str(ScorerName.TRIG)
    sink_tokens: int = SINK_TOKENS
    recent_tokens: int = RECENT_TOKENS
    solver: str = "manual"
    predicted_loss: float | None = None
    bytes_planned: int | None = None

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        for i, c in enumerate(layers):
            if not isinstance(c, LayerConfig):
                raise PlanError(f"layers[{i}] must be a LayerConfig; got {type(c).__name__}")
        if len(layers) != self.fingerprint.num_layers:
            raise PlanError(
                f"the plan has {len(layers)} layer configs but its model has "
                f"num_layers={self.fingerprint.num_layers}; give exactly one config per layer"
            )
        for name in ("budget_bytes", "context_length", "group_size"):
            check_int(name, getattr(self, name), error=PlanError)
        check_power_of_two("group_size", self.group_size, error=PlanError)
        object.__setattr__(self, "scorer", str(check_choice("scorer", self.scorer, ScorerName, error=PlanError)))
        for name in ("sink_tokens", "recent_tokens"):
            check_int(name, getattr(self, name), minimum=0, error=PlanError)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_model(self, model_or_fingerprint: Any) -> None:
        """Raise :class:`PlanError` if this plan was made for a different model."""
        fp = (
            model_or_fingerprint
            if isinstance(model_or_fingerprint, ModelFingerprint)
            else ModelFingerprint.from_model(model_or_fingerprint)
        )
        msg = self.fingerprint.mismatch(fp, "plan")
        if msg:
            raise PlanError(msg + "; calibrate and solve a plan for this model")

    @classmethod
    def uniform(cls, config: LayerConfig, fingerprint: ModelFingerprint, context_length: int, *,
                calibrated: bool = True, **kw: Any) -> RoutingPlan:
        """The same config on every layer; ``budget_bytes`` and ``bytes_planned`` default to what it takes at
        ``context_length`` tokens, priced with the plan's own kept-token floor (``sink_tokens +
        recent_tokens`` from ``kw``, else the defaults). calibrated: price the eviction state of a cache with
        calibrated query statistics (``prepare(model, plan, table=...)``); False for a cache prepared without a
        table, whose scorer keeps a query window instead (``prepare`` refuses a plan priced for less)."""
        layers = (config,) * fingerprint.num_layers
        floor = kw.get("sink_tokens", SINK_TOKENS) + kw.get("recent_tokens", RECENT_TOKENS)
        used = sum(plan_layer_bytes(c, context_length, fingerprint, group_size=kw.get("group_size", GROUP_SIZE),
                                    floor=floor, scorer=kw.get("scorer", ScorerName.TRIG), layer=i,
                                    calibrated=calibrated)
                   for i, c in enumerate(layers))
        kw.setdefault("budget_bytes", used)
        kw.setdefault("bytes_planned", used)
        return cls(layers=layers, fingerprint=fingerprint, context_length=context_length, **kw)

    # -- JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_FORMAT_VERSION,
            "model": self.fingerprint.to_dict(),
            "grid": self.grid.to_dict(),
            "budget_bytes": self.budget_bytes,
            "context_length": self.context_length,
            "group_size": self.group_size,
            "scorer": self.scorer,
            "sink_tokens": self.sink_tokens,
            "recent_tokens": self.recent_tokens,
            "solver": self.solver,
            "predicted_loss": self.predicted_loss,
            "bytes_planned": self.bytes_planned,
            "layers": [c.to_dict() for c in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Any) -> RoutingPlan:
        _check_header(d)
        layers = tuple(LayerConfig.from_dict(c, f"layers[{i}]") for i, c in enumerate(d["layers"]))
        grid = Grid.from_dict(d["grid"])
        known = set(grid.configs)
        for i, c in enumerate(layers):
            if c not in known:
                raise PlanError(f"layers[{i}]={c.name} is not in the plan's grid {grid.describe()}")
        pl = d.get("predicted_loss")
        if pl is not None and not isinstance(pl, (int, float)):
            raise PlanError(f"predicted_loss={pl!r} must be a number or null")
        return cls(
            layers=layers,
            fingerprint=ModelFingerprint.from_dict(d["model"]),
            budget_bytes=d["budget_bytes"],
            context_length=d["context_length"],
            grid=grid,
            group_size=d.get("group_size", GROUP_SIZE),
            scorer=d.get("scorer", str(ScorerName.TRIG)),
            sink_tokens=d.get("sink_tokens", SINK_TOKENS),
            recent_tokens=d.get("recent_tokens", RECENT_TOKENS),
            solver=str(d.get("solver", "manual")),
            predicted_loss=None if pl is None else float(pl),
            bytes_planned=d.get("bytes_planned"),
        )

    @classmethod
    def from_json(cls, text: str) -> RoutingPlan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON atomically (temp file + rename)."""
        return atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingPlan:
        data = read_existing(path, "plan file", PlanError)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"plan file {str(Path(path))!r} is not UTF-8 text (a plan is JSON)") from None
        return cls.from_json(text)


def _check_header(d: Any) -> None:
    """A plan JSON object's format, version and required fields, before any field is read."""
    if not isinstance(d, dict):
        raise PlanError(f"a plan must be a JSON object; got {type(d).__name__}")
    if d.get("format") != PLAN_FORMAT:
        raise PlanError(f"format={d.get('format')!r} is not a moend_fx plan; expected {PLAN_FORMAT!r}")
    if d.get("version") != PLAN_FORMAT_VERSION:
        raise PlanError(f"plan version={d.get('version')!r} is unsupported; allowed: [{PLAN_FORMAT_VERSION}]")
    missing = [k for k in ("model", "grid", "budget_bytes", "context_length", "layers") if k not in d]
    if missing:
        raise PlanError(f"plan is missing field(s) {missing}")
    if not isinstance(d["layers"], list):
        raise PlanError(f"plan field layers must be a list; got {type(d['layers']).__name__}")
