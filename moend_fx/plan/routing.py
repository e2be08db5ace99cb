"""The routing plan as data: per-layer compression configs, the grid they come from, and the model they fit.

A :class:`RoutingPlan` is a frozen value that serialises to versioned JSON (see ``docs/plan-format.md``).
Loading validates every field and names the field, the bad value and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moend_fx.common.errors import PlanError
from moend_fx.common.io import atomic_write_text

PLAN_FORMAT_VERSION = 1
ALLOWED_BITS: tuple[int, ...] = (2, 4, 8, 16)
PAPER_KEEP_RATIOS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
PAPER_BITS: tuple[int, ...] = (16, 8, 4)
ALLOWED_SCORERS: tuple[str, ...] = ("trig", "snapkv", "keynorm", "streaming", "h2o")


def check_bits(name: str, bits: Any) -> int:
    """Validate a bit width; ``name`` is the field named in the error."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ALLOWED_BITS:
        raise PlanError(f"{name}={bits!r} is not a supported bit width; allowed: {list(ALLOWED_BITS)}")
    return bits


def check_keep_ratio(name: str, keep: Any) -> float:
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
        check_bits("k_bits", self.k_bits)
        check_bits("v_bits", self.v_bits)

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
        for name in ("keep_ratios", "k_bits", "v_bits"):
            vals = tuple(getattr(self, name))
            if not vals:
                raise PlanError(f"grid field {name} is empty; give at least one value")
            if len(set(vals)) != len(vals):
                raise PlanError(f"grid field {name}={list(vals)} has duplicates")
            object.__setattr__(self, name, vals)
        for i, k in enumerate(self.keep_ratios):
            check_keep_ratio(f"grid.keep_ratios[{i}]", k)
        object.__setattr__(self, "keep_ratios", tuple(float(k) for k in self.keep_ratios))
        for i, b in enumerate(self.k_bits):
            check_bits(f"grid.k_bits[{i}]", b)
        for i, b in enumerate(self.v_bits):
            check_bits(f"grid.v_bits[{i}]", b)

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
        for k in ("keep_ratios", "k_bits", "v_bits"):
            if not isinstance(d.get(k), list):
                raise PlanError(f"grid field {k} must be a list; got {d.get(k)!r}")
        return cls(tuple(d["keep_ratios"]), tuple(d["k_bits"]), tuple(d["v_bits"]))


@dataclass(frozen=True)
class ModelFingerprint:
    """What a plan or table must match to be applied to a model."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    dtype: str = "float32"

    @classmethod
    def from_model(cls, model: Any) -> ModelFingerprint:
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        return cls(arch, int(cfg.num_hidden_layers), kv, head_dim, heads, dtype)

    def mismatch(self, other: ModelFingerprint, what: str = "plan") -> str | None:
        """A sentence naming the first field that differs, or None (dtype may differ)."""
        for f in ("architecture", "num_layers", "num_kv_heads", "head_dim", "num_heads"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"the {what} was made for a model with {f}={a!r}, but this model has {f}={b!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelFingerprint:
        if not isinstance(d, dict):
            raise PlanError(f"model fingerprint must be an object; got {d!r}")
        want = {"architecture": str, "num_layers": int, "num_kv_heads": int, "head_dim": int, "num_heads": int}
        for k, t in want.items():
            if not isinstance(d.get(k), t) or isinstance(d.get(k), bool):
                raise PlanError(f"model.{k}={d.get(k)!r} is invalid; expected a {t.__name__}")
            if t is int and d[k] <= 0:
                raise PlanError(f"model.{k}={d[k]!r} must be positive")
        return cls(**{k: d[k] for k in want}, dtype=str(d.get("dtype", "float32")))


@dataclass(frozen=True)
class RoutingPlan:
    """One :class:`LayerConfig` per layer, with the budget and context it was solved for.

    ``budget_bytes`` and ``context_length`` are what the solver targeted; ``bytes_planned`` is what the
    memory model says the plan takes at ``context_length`` tokens (batch 1).
    """

    layers: tuple[LayerConfig, ...]
    fingerprint: ModelFingerprint
    budget_bytes: int
    context_length: int
    grid: Grid = field(default_factory=Grid)
    group_size: int = 32
    scorer: str = "trig"
    sink_tokens: int = 4
    recent_tokens: int = 32
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
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise PlanError(f"{name}={v!r} is invalid; allowed: a positive integer")
        if self.group_size & (self.group_size - 1):
            raise PlanError(f"group_size={self.group_size} is invalid; allowed: a power of two (e.g. 32)")
        if self.scorer not in ALLOWED_SCORERS:
            raise PlanError(f"scorer={self.scorer!r} is unknown; allowed: {list(ALLOWED_SCORERS)}")
        for name in ("sink_tokens", "recent_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"{name}={v!r} is invalid; allowed: an integer >= 0")

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
    def uniform(cls, config: LayerConfig, fingerprint: ModelFingerprint, context_length: int,
                **kw: Any) -> RoutingPlan:
        """The same config on every layer (budget defaults to what it takes)."""
        from moend_fx.plan.memory import plan_layer_bytes

        layers = (config,) * fingerprint.num_layers
        gs = kw.get("group_size", 32)
        used = sum(plan_layer_bytes(c, context_length, fingerprint, group_size=gs) for c in layers)
        kw.setdefault("budget_bytes", used)
        kw.setdefault("bytes_planned", used)
        return cls(layers=layers, fingerprint=fingerprint, context_length=context_length, **kw)

    # -- JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "moend_fx.plan.routing",
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
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object; got {type(d).__name__}")
        if d.get("format") != "moend_fx.plan.routing":
            raise PlanError(f"format={d.get('format')!r} is not a moend_fx plan; expected 'moend_fx.plan.routing'")
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan version={d.get('version')!r} is unsupported; allowed: [{PLAN_FORMAT_VERSION}]")
        required = ["model", "grid", "budget_bytes", "context_length", "layers"]
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanError(f"plan is missing field(s) {missing}")
        if not isinstance(d["layers"], list):
            raise PlanError(f"plan field layers must be a list; got {type(d['layers']).__name__}")
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
            group_size=d.get("group_size", 32),
            scorer=d.get("scorer", "trig"),
            sink_tokens=d.get("sink_tokens", 4),
            recent_tokens=d.get("recent_tokens", 32),
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
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {str(p)!r} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"plan file {str(p)!r} is not UTF-8 text (a plan is JSON)") from None
        return cls.from_json(text)

    def summary_rows(self) -> list[dict[str, Any]]:
        from moend_fx.plan.memory import plan_layer_bytes

        return [
            {"layer": i, "keep_ratio": c.keep_ratio, "k_bits": c.k_bits, "v_bits": c.v_bits,
             "bytes": plan_layer_bytes(c, self.context_length, self.fingerprint, group_size=self.group_size)}
            for i, c in enumerate(self.layers)
        ]
