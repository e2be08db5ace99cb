"""What one evaluation run measures (EvalConfig) and what it returns (EvalResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.eval.methods import (
    METHODS,
)
from moend_fx.eval.tasks.registry import SETTINGS, TASKS
from moend_fx.eviction.scoring import SCORERS

# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class EvalConfig:
    """What to run. budgets: ratios of the 16-bit cache ("14x") or sizes ("3.3MB"); settings: SETTINGS.

    max_new_tokens: decode cap per answer (raised to ``tokens_per_answer`` x answers for multi-answer tasks).
    window: post-RoPE queries recorded per layer for scorers without calibrated stats.
    """

    tasks: tuple[str, ...] = ("passkey",)
    lengths: tuple[int, ...] = (2048,)
    n: int = 30
    budgets: tuple[str, ...] = ("4x", "8x", "14x")
    methods: tuple[str, ...] = ("full", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero", "2d_hetero_exact")
    settings: tuple[str, ...] = SETTINGS
    seed: int = 0
    max_new_tokens: int = 24
    tokens_per_answer: int = 8
    window: int = 32
    evict_every: int = 128
    scorer: str | None = None  # override the plan's eviction scorer (e.g. "snapkv") for every MoENDCache method
    calibrated_stats: bool = True  # trig: the table's query statistics (False: estimate from the query window)

    def __post_init__(self) -> None:
        for name in ("tasks", "lengths", "budgets", "methods", "settings"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise MoendError(f"{name} is empty; give at least one")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise MoendError(f"task {bad[0]!r} is unknown; allowed: {', '.join(TASKS)}")
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise MoendError(f"setting {bad[0]!r} is unknown; allowed: {', '.join(SETTINGS)}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise MoendError(f"method {bad[0]!r} is unknown; allowed: {', '.join(METHODS)}")
        for name in ("n", "max_new_tokens", "window", "evict_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoendError(f"{name}={v!r} is invalid; allowed: an integer >= 1")
        if self.scorer is not None and self.scorer not in SCORERS:
            raise MoendError(f"scorer {self.scorer!r} is unknown; allowed: {', '.join(sorted(SCORERS))}")
        for length in self.lengths:
            if isinstance(length, bool) or not isinstance(length, int) or length < 16:
                raise MoendError(f"length {length!r} is invalid; allowed: an integer >= 16 (tokens)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    records: list[dict[str, Any]]
    plans: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
