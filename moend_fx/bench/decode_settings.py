"""What the decode benchmark runs: its methods and :class:`DecodeBenchSettings`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from moend_fx.bench.capacity import parse_memory_cap
from moend_fx.common.checks import check_choice, check_int, check_names
from moend_fx.common.defaults import EVICT_EVERY
from moend_fx.common.errors import MoendError
from moend_fx.common.options import InnerCompiler, Kernel, ReEviction
from moend_fx.plan.config import LayerConfig

METHODS: tuple[str, ...] = ("full_eager", "full_inductor", "moend_eager", "moend_compiled")
BASELINE = "full_eager"
DEFAULT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192)
DEFAULT_UNIFORM = LayerConfig(0.25, 4, 4)
DEFAULT_BANDWIDTH_GBS = 28.0  # design.md: ~27-30 GB/s measured on this machine
_BATCHES_ALLOWED = "comma-separated positive integers, each once (e.g. 1,4,8,16)"


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What to run. ``budget`` is used only with a table (solved with greedy per context length);
    without a table or plan every layer gets ``uniform``. ``kernel`` and ``inner``: options of the ``moend``
    backend (the ``moend_compiled`` method).

    batches: batch sizes measured (each row of a batch holds its own random tokens, same length, no padding) at
    the lengths in ``batch_lengths`` (None: every length); the other lengths run at batch 1 only.
    memory_cap: None, or a size ("8GB", "7.5GiB"): the largest batch each method fits under it, predicted from
    the memory model (:mod:`moend_fx.bench.capacity`).
    evict_every, reevict: the MoENDCache rows' eviction options (``MoENDCache``'s own; its defaults): how much
    room a layer leaves when it evicts (``min(evict_every, 32)`` tokens, so ``evict_every=1`` re-evicts at every
    step once the cap is reached) and what a decode-time re-eviction drops (whole ``groups`` or single
    ``tokens``). The measured steps then include that re-eviction work: compare ``ms_mean``, which counts it
    at its true rate, not only the median.

    prefill_chunk: 0 (one forward over the context), or tokens per prefill forward, each chunk fed through the
    cache before the next, as ``generate``'s chunked prefill does (``moend_fx.prepare`` chunks MoENDCache prompts
    above 4096 tokens): what a long hybrid prompt needs, whose one-pass SDPA runs every sliding layer over a dense
    [T, T] mask. Decode steps are measured after it either way."""

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
    batches: tuple[int, ...] = (1,)
    batch_lengths: tuple[int, ...] | None = None
    memory_cap: str | None = None
    evict_every: int = EVICT_EVERY
    reevict: ReEviction = ReEviction.GROUPS
    prefill_chunk: int = 0

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
        check_int("evict_every", self.evict_every)
        check_int("prefill_chunk", self.prefill_chunk, minimum=0)
        object.__setattr__(self, "reevict", check_choice("reevict", self.reevict, ReEviction))
        self._check_batches()
        if self.memory_cap is not None:
            parse_memory_cap(self.memory_cap)

    def _check_batches(self) -> None:
        batches = tuple(self.batches)
        if not batches or len(set(batches)) != len(batches):
            raise MoendError(f"batches={list(batches)} is invalid; allowed: {_BATCHES_ALLOWED}")
        for b in batches:
            check_int("batch size", b)
        object.__setattr__(self, "batches", batches)
        if self.batch_lengths is not None:
            bl = tuple(self.batch_lengths)
            bad = [n for n in bl if n not in self.lengths]
            if not bl or bad:
                raise MoendError(f"batch_lengths={list(bl)} is invalid; allowed: a non-empty subset of the context "
                                 f"lengths {list(self.lengths)}")
            object.__setattr__(self, "batch_lengths", bl)

    def batches_at(self, length: int) -> tuple[int, ...]:
        """The batch sizes measured at context ``length``: every batch at a batch length, else batch 1 only."""
        if self.batch_lengths is None or length in self.batch_lengths:
            return self.batches
        return (1,)

    @property
    def memory_cap_bytes(self) -> int | None:
        return None if self.memory_cap is None else parse_memory_cap(self.memory_cap)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["uniform"] = self.uniform.to_dict()
        d["kernel"], d["inner"], d["reevict"] = str(self.kernel), str(self.inner), str(self.reevict)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeBenchSettings:
        """The inverse of :meth:`to_dict` (JSON lists back to tuples)."""
        kw = dict(d, uniform=LayerConfig.from_dict(d["uniform"]))
        for name in ("lengths", "methods", "batches", "batch_lengths"):
            if kw.get(name) is not None:
                kw[name] = tuple(kw[name])
        return cls(**kw)

    @property
    def cache_kwargs(self) -> dict[str, Any]:
        """The MoENDCache options the MoENDCache rows build their caches with."""
        return {"evict_every": self.evict_every, "reevict": self.reevict}


def parse_methods(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"full_eager,moend_eager"`` or ``"all"`` -> a checked tuple of method names."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if items == ["all"]:
        return METHODS
    bad = [m for m in items if m not in METHODS]
    if bad or not items:
        raise MoendError(f"methods {text!r} are invalid; allowed: 'all' or a comma list of {', '.join(METHODS)}")
    return tuple(items)


def parse_batches(text: str, what: str = "--batches") -> tuple[int, ...]:
    """``"1,4,8,16"`` -> ``(1, 4, 8, 16)``; anything else (empty, not an integer, <= 0, a size twice) is a
    :class:`MoendError` naming ``what`` and the allowed form."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    try:
        vals = tuple(int(s) for s in items)
    except ValueError:
        vals = ()
    if not vals or any(v <= 0 for v in vals) or len(set(vals)) != len(vals):
        raise MoendError(f"{what}={text!r} is invalid; allowed: {_BATCHES_ALLOWED}")
    return vals
