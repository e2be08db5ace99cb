"""The candidate configs per layer: a cross product of keep ratios and K / V bit widths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moend_fx.common.errors import PlanError
from moend_fx.plan.config import LayerConfig, check_keep_ratio, check_plan_bits

PAPER_KEEP_RATIOS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
PAPER_BITS: tuple[int, ...] = (16, 8, 4)
_AXES = ("keep_ratios", "k_bits", "v_bits")


@dataclass(frozen=True)
class Grid:
    """The candidate configs per layer: the cross product keep_ratios x k_bits x v_bits.

    Config index ``c`` enumerates keep ratios slowest and V bits fastest, in the order given.
    The default is the paper's grid of 6 x 3 x 3 = 54 configs.
    """

    keep_ratios: tuple[float, ...] = PAPER_KEEP_RATIOS
    k_bits: tuple[int, ...] = PAPER_BITS
    v_bits: tuple[int, ...] = PAPER_BITS

    def __post_init__(self) -> None:
        for name in _AXES:
            vals = tuple(getattr(self, name))
            if not vals:
                raise PlanError(f"grid field {name} is empty; give at least one value")
            if len(set(vals)) != len(vals):
                raise PlanError(f"grid field {name}={list(vals)} has duplicates")
            object.__setattr__(self, name, vals)
        object.__setattr__(self, "keep_ratios", tuple(check_keep_ratio(f"grid.keep_ratios[{i}]", k)
                                                      for i, k in enumerate(self.keep_ratios)))
        for name in ("k_bits", "v_bits"):
            object.__setattr__(self, name, tuple(check_plan_bits(f"grid.{name}[{i}]", b)
                                                 for i, b in enumerate(getattr(self, name))))

    @property
    def configs(self) -> tuple[LayerConfig, ...]:
        return tuple(
            LayerConfig(k, kb, vb) for k in self.keep_ratios for kb in self.k_bits for vb in self.v_bits
        )

    def __len__(self) -> int:
        return len(self.keep_ratios) * len(self.k_bits) * len(self.v_bits)

    def index(self, config: LayerConfig) -> int:
        try:
            return self.configs.index(config)
        except ValueError:
            raise PlanError(f"config {config.name} is not in the grid {self.describe()}") from None

    def describe(self) -> str:
        return f"keep={list(self.keep_ratios)} x K={list(self.k_bits)} x V={list(self.v_bits)}"

    def to_dict(self) -> dict[str, Any]:
        return {"keep_ratios": list(self.keep_ratios), "k_bits": list(self.k_bits), "v_bits": list(self.v_bits)}

    @classmethod
    def from_dict(cls, d: Any) -> Grid:
        if not isinstance(d, dict):
            raise PlanError(f"grid must be an object with keep_ratios, k_bits, v_bits; got {d!r}")
        for k in _AXES:
            if not isinstance(d.get(k), list):
                raise PlanError(f"grid field {k} must be a list; got {d.get(k)!r}")
        return cls(tuple(d["keep_ratios"]), tuple(d["k_bits"]), tuple(d["v_bits"]))
