"""What one evaluation run measures (EvalConfig) and what it returns (EvalResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moend_fx.common.checks import check_choice, check_int, check_names
from moend_fx.common.defaults import EVICT_EVERY, QUERY_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode, ReEviction, Setting
from moend_fx.eval.methods import METHODS
from moend_fx.eval.tasks.registry import TASKS
from moend_fx.eviction.scorers import SCORERS

MIN_LENGTH = 16  # tokens: the shortest prompt length an evaluation accepts


@dataclass(frozen=True)
class EvalConfig:
    """What to run. budgets: ratios of the 16-bit cache ("14x") or sizes ("3.3MB"); settings: members of
    :class:`~moend_fx.common.options.Setting` (names are accepted and held as members).

    max_new_tokens: decode cap per answer (raised to ``tokens_per_answer`` x answers for multi-answer tasks).
    window: post-RoPE queries recorded per layer for scorers without calibrated stats.
    """

    tasks: tuple[str, ...] = ("passkey",)
    lengths: tuple[int, ...] = (2048,)
    n: int = 30
    budgets: tuple[str, ...] = ("4x", "8x", "14x")
    methods: tuple[str, ...] = ("full", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero", "2d_hetero_exact")
    settings: tuple[Setting, ...] = tuple(Setting)
    seed: int = 0
    max_new_tokens: int = 24
    tokens_per_answer: int = 8
    window: int = QUERY_WINDOW
    evict_every: int = EVICT_EVERY
    scorer: str | None = None  # override the plan's eviction scorer (e.g. "snapkv") for every MoENDCache method
    calibrated_stats: bool = True  # trig: the table's query statistics (False: estimate from the query window)
    reevict: ReEviction = ReEviction.GROUPS  # what MoENDCache's decode-time re-evictions drop: groups or tokens
    budget_mode: BudgetMode = BudgetMode.CAPACITY  # MoENDCache's: a byte cap at every step, or a ratio re-evicted

    def __post_init__(self) -> None:
        for name in ("lengths", "budgets", "settings"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise MoendError(f"{name} is empty; give at least one")
        object.__setattr__(self, "tasks", check_names("tasks", "task", self.tasks, TASKS))
        object.__setattr__(self, "settings", tuple(check_choice("setting", s, Setting) for s in self.settings))
        object.__setattr__(self, "reevict", check_choice("reevict", self.reevict, ReEviction))
        object.__setattr__(self, "budget_mode", check_choice("budget_mode", self.budget_mode, BudgetMode))
        object.__setattr__(self, "methods", check_names("methods", "method", self.methods, METHODS))
        for name in ("n", "max_new_tokens", "tokens_per_answer", "window", "evict_every"):
            check_int(name, getattr(self, name))
        if self.scorer is not None and self.scorer not in SCORERS:
            raise MoendError(f"scorer {self.scorer!r} is unknown; allowed: {', '.join(sorted(SCORERS))}")
        for length in self.lengths:
            check_int("length", length, minimum=MIN_LENGTH)

    def max_new(self, answers: int) -> int:
        """Decode cap for an example with ``answers`` expected answers."""
        return max(self.max_new_tokens, self.tokens_per_answer * answers)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "settings": tuple(str(s) for s in self.settings), "reevict": str(self.reevict),
                "budget_mode": str(self.budget_mode)}


@dataclass
class EvalResult:
    records: list[dict[str, Any]]
    plans: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
