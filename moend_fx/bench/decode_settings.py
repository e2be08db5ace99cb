"""What the decode benchmark runs: its methods and :class:`DecodeBenchSettings`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from moend_fx.common.checks import check_choice, check_int, check_names
from moend_fx.common.errors import MoendError
from moend_fx.common.options import InnerCompiler, Kernel
from moend_fx.plan.config import LayerConfig

METHODS: tuple[str, ...] = ("full_eager", "full_inductor", "moend_eager", "moend_compiled")
BASELINE = "full_eager"
DEFAULT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192)
DEFAULT_UNIFORM = LayerConfig(0.25, 4, 4)
DEFAULT_BANDWIDTH_GBS = 28.0  # design.md: ~27-30 GB/s measured on this machine


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What to run. ``budget`` is used only with a table (solved with greedy per context length);
    without a table or plan every layer gets ``uniform``. ``kernel`` and ``inner``: options of the ``moend``
    backend (the ``moend_compiled`` method)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    steps: int = 16
    warmup: int = 3
    methods: tuple[str, ...] = METHODS
    budget: str = "14x"
    uniform: LayerConfig = DEFAULT_UNIFORM
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS
    seed: int = 0
    kernel: Kernel = Kernel.AUTO
    inner: InnerCompiler = InnerCompiler.INDUCTOR

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", check_names("methods", "method", self.methods, METHODS, unique=True))
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if not self.lengths:
            raise MoendError("lengths is empty; give at least one")
        for n in self.lengths:
            check_int("context length", n, minimum=2)
        check_int("steps", self.steps)
        check_int("warmup", self.warmup, minimum=0)
        if not self.bandwidth_gbs > 0:
            raise MoendError(f"bandwidth_gbs={self.bandwidth_gbs!r} is invalid; allowed: a positive number")
        if not isinstance(self.uniform, LayerConfig):
            raise MoendError(f"uniform must be a LayerConfig; got {type(self.uniform).__name__}")
        object.__setattr__(self, "kernel", check_choice("kernel", self.kernel, Kernel))
        object.__setattr__(self, "inner", check_choice("inner", self.inner, InnerCompiler))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["uniform"] = self.uniform.to_dict()
        d["kernel"], d["inner"] = str(self.kernel), str(self.inner)
        return d


def parse_methods(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"full_eager,moend_eager"`` or ``"all"`` -> a checked tuple of method names."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if items == ["all"]:
        return METHODS
    bad = [m for m in items if m not in METHODS]
    if bad or not items:
        raise MoendError(f"methods {text!r} are invalid; allowed: 'all' or a comma list of {', '.join(METHODS)}")
    return tuple(items)
