"""One compression "expert": the keep ratio and K / V bit widths a layer is compressed with."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from moend_fx.common.checks import check_bits
from moend_fx.common.errors import PlanError

ALLOWED_BITS: tuple[int, ...] = (2, 4, 8, 16)
"""Bit widths a plan may name: 16 = stored unquantized; 8, 4 and 2 = packed codes (2 is an extension of the
paper's grid)."""


def check_plan_bits(name: str, bits: Any) -> int:
    """``bits`` as an int if it is a width a plan may use (:data:`ALLOWED_BITS`), else :class:`PlanError`."""
    return check_bits(name, bits, allowed=ALLOWED_BITS, error=PlanError)


def check_keep_ratio(name: str, keep: Any) -> float:
    """``keep`` as a float if it is a finite number in (0, 1], else :class:`PlanError` naming ``name``."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep):
        raise PlanError(f"{name}={keep!r} is not a number; allowed: a float in (0, 1]")
    if not 0.0 < float(keep) <= 1.0:
        raise PlanError(f"{name}={keep!r} is outside the allowed range (0, 1]")
    return float(keep)


@dataclass(frozen=True, order=True)
class LayerConfig:
    """One compression "expert": the fraction of tokens a layer keeps and its K / V bit widths.

    ``bits == 16`` means stored as is, in the model's own dtype (lossless).
    """

    keep_ratio: float
    k_bits: int
    v_bits: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_ratio", check_keep_ratio("keep_ratio", self.keep_ratio))
        object.__setattr__(self, "k_bits", check_plan_bits("k_bits", self.k_bits))
        object.__setattr__(self, "v_bits", check_plan_bits("v_bits", self.v_bits))

    @property
    def lossless(self) -> bool:
        return self.keep_ratio == 1.0 and self.k_bits == 16 and self.v_bits == 16

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def evicts(self) -> bool:
        return self.keep_ratio < 1.0

    @property
    def name(self) -> str:
        return f"keep{self.keep_ratio:g}_k{self.k_bits}_v{self.v_bits}"

    def to_dict(self) -> dict[str, Any]:
        return {"keep_ratio": self.keep_ratio, "k_bits": self.k_bits, "v_bits": self.v_bits}

    @classmethod
    def from_name(cls, name: Any, where: str = "layer config") -> LayerConfig:
        """The config whose :attr:`name` is ``name`` (``keep<ratio>_k<bits>_v<bits>``, e.g. ``keep0.5_k4_v4``)."""
        m = re.fullmatch(r"keep([0-9.]+(?:e-?[0-9]+)?)_k([0-9]+)_v([0-9]+)", name) if isinstance(name, str) else None
        if m is None:
            raise PlanError(f"{where}={name!r} is not a config name; expected keep<ratio>_k<bits>_v<bits>, "
                            f"e.g. keep0.5_k4_v4")
        try:
            return cls(float(m[1]), int(m[2]), int(m[3]))
        except (PlanError, ValueError) as e:
            raise PlanError(f"{where}={name!r}: {e}") from None

    @classmethod
    def from_dict(cls, d: Any, where: str = "layer config") -> LayerConfig:
        if not isinstance(d, dict):
            raise PlanError(f"{where} must be an object with keep_ratio, k_bits, v_bits; got {d!r}")
        missing = {"keep_ratio", "k_bits", "v_bits"} - set(d)
        if missing:
            raise PlanError(f"{where} is missing field(s) {sorted(missing)}")
        try:
            return cls(d["keep_ratio"], d["k_bits"], d["v_bits"])
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None
