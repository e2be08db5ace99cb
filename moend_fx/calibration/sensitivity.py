"""Per-layer sensitivity table S[layer, config] (MoE-nD's offline calibration result), saved as safetensors.

File layout (format ``moend_fx.calibration.sensitivity``, version 1; see ``docs/calibration.md``):

* tensors: ``S`` [L, C] float64, optionally ``gain`` [L] float64 (per-layer gains, see
  :attr:`SensitivityTable.gain`), and the calibrated pre-RoPE query statistics of the ``trig`` scorer,
  ``query_stats.layers.{l}.sum`` [H, D/2, 2] float64, ``.abs_sum`` [H, D/2] float64, ``.count`` [1] int64.
* safetensors metadata (strings): ``format``, ``version``, ``meta`` (JSON: grid, model fingerprint,
  group_size, calibration settings) and ``sha256`` (over ``meta`` and every tensor's name, dtype, shape
  and bytes).

Loading checks the format, the version, the hash, the shapes against the grid and the fingerprint, and raises
:class:`~moend_fx.common.errors.TableError` naming what is wrong. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.calibration.stats_arrays import STATS_PREFIX, _check_stats, _stats_key
from moend_fx.common.checks import check_int
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError, PlanError, TableError
from moend_fx.common.io import atomic_write_bytes, read_existing
from moend_fx.common.options import ScorerName
from moend_fx.plan.memory import plan_layer_bytes
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan

TABLE_FORMAT = "moend_fx.calibration.sensitivity"
TABLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class SensitivityTable:
    """``S[l, c]``: relative L2 error of layer l's attention output under ``grid.configs[c]`` alone.

    S: [L, C] float64, L = fingerprint.num_layers, C = len(grid).
    gain: [L] float64 > 0, or None. With gains the predicted loss of a plan is an estimate of its end-to-end
    KL (nats per token), ``sum_l gain[l] * S[l, c_l] ** 2``: an output error reaches the logits about linearly,
    KL is quadratic in a small logit change, and layers differ by orders of magnitude in how much of their
    error reaches the logits (``moend_fx.calibration.gains``). Without (None), the paper's ``sum_l S[l, c_l]``.
    :attr:`loss` is the matrix every solver and report minimises or sums.
    query_stats: flat name -> array dict (see the module docstring); :meth:`layer_stats` builds the
    :class:`~moend_fx.eviction.query_stats.QueryStats` of one layer for the ``trig`` scorer.
    """

    S: np.ndarray
    grid: Grid
    fingerprint: ModelFingerprint
    group_size: int = GROUP_SIZE
    calibration: dict[str, Any] = field(default_factory=dict)
    query_stats: dict[str, np.ndarray] = field(default_factory=dict)
    gain: np.ndarray | None = None
    # (scorer, calibrated) the byte costs are priced for, when a cache will evict otherwise than the table's own
    # scorer with its statistics (see priced_for); not saved
    pricing: tuple[str, bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        S = np.asarray(self.S, dtype=np.float64)
        want = (self.fingerprint.num_layers, len(self.grid))
        if S.shape != want:
            raise TableError(f"S has shape {S.shape} but the model has {want[0]} layers and the grid "
                             f"{want[1]} configs; expected {want}")
        if not np.isfinite(S).all():
            raise TableError("S holds non-finite values (NaN or inf); recalibrate")
        object.__setattr__(self, "S", S)
        if self.gain is not None:
            gain = np.asarray(self.gain, dtype=np.float64)
            if gain.shape != (want[0],) or not np.isfinite(gain).all() or (gain <= 0).any():
                raise TableError(f"gain must be [{want[0]}] finite and > 0 (one per layer); got shape "
                                 f"{gain.shape}, min {gain.min() if gain.size else None}")
            object.__setattr__(self, "gain", gain)
        check_int("group_size", self.group_size, error=TableError)
        object.__setattr__(self, "query_stats", {k: np.asarray(v) for k, v in self.query_stats.items()})

    # -- queries --------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    @property
    def configs(self) -> tuple[LayerConfig, ...]:
        return self.grid.configs

    def bytes_matrix(self, context_length: int, batch: int = 1) -> np.ndarray:
        """[L, C] int64: every byte each config takes on each layer at ``context_length`` tokens, the eviction
        state of the table's scorer (with this table's query statistics, when it has them) included. A
        sliding-window layer is priced by its window (``ModelFingerprint.layer_tokens``, ``memory.sliding_kept``)."""
        fp = self.fingerprint
        rows = {i: [self.config_bytes(c, context_length, batch, i) for c in self.grid.configs]
                for i in {None, *fp.sliding[:1]}}  # None: a full-attention layer
        return np.array([rows[fp.sliding[0] if fp.is_sliding(i) else None] for i in range(fp.num_layers)], np.int64)

    def config_bytes(self, config: LayerConfig, context_length: int, batch: int = 1, layer: int | None = None) -> int:
        """Every byte one layer at ``config`` takes at ``context_length`` tokens, priced as :meth:`bytes_matrix`
        prices the grid's configs (``config`` need not be in the grid); ``layer``: its index (None: full attention)."""
        scorer, calibrated = self.pricing or (str(self.calibration.get("scorer", ScorerName.TRIG)), self.has_stats())
        return plan_layer_bytes(config, context_length, self.fingerprint, group_size=self.group_size, batch=batch,
                                scorer=scorer, calibrated=calibrated, layer=layer)

    @property
    def loss(self) -> np.ndarray:
        """[L, C] float64: each entry's predicted loss, ``gain[l] * S[l, c] ** 2`` with gains, else ``S``."""
        return self.S if self.gain is None else self.gain[:, None] * self.S ** 2

    def _index(self, config: LayerConfig) -> int:
        try:
            return self.grid.index(config)
        except PlanError as e:
            raise TableError(str(e)) from None

    def column(self, config: LayerConfig) -> np.ndarray:
        """S[:, c] for one config: [L]. Raises TableError if the config is not in the grid."""
        return self.S[:, self._index(config)]

    def predicted_loss(self, plan_or_configs: RoutingPlan | list[LayerConfig] | tuple[LayerConfig, ...]) -> float:
        """``sum_l loss[l, c_l]`` for a plan (or one config per layer): see :attr:`loss`."""
        layers = plan_or_configs.layers if isinstance(plan_or_configs, RoutingPlan) else tuple(plan_or_configs)
        if len(layers) != self.num_layers:
            raise TableError(f"{len(layers)} layer configs given; this table has {self.num_layers} layers")
        loss = self.loss
        return float(sum(loss[i, self._index(c)] for i, c in enumerate(layers)))

    def spread(self, config: LayerConfig) -> float:
        """max / min over layers of S[:, config] (inf if some layer has S == 0 but not all)."""
        col = self.column(config)
        hi, lo = float(col.max()), float(col.min())
        if lo <= 0:
            return float("nan") if hi <= 0 else float("inf")
        return hi / lo

    def priced_for(self, scorer: str, calibrated: bool) -> SensitivityTable:
        """This table with its byte costs (:meth:`bytes_matrix`) priced for caches that evict with ``scorer``,
        with calibrated query statistics or not, instead of the table's own scorer and statistics: what a plan
        solved on it must budget when the cache overrides the scorer (its eviction state differs)."""
        return dataclasses.replace(self, pricing=(str(scorer), bool(calibrated)))

    def has_stats(self) -> bool:
        return bool(self.query_stats)

    def layer_stats(self, layer: int) -> Any:
        """The calibrated :class:`~moend_fx.eviction.query_stats.QueryStats` of ``layer`` (TableError if absent)."""
        from moend_fx.eviction.query_stats import QueryStats

        prefix = _stats_key(layer, "")
        if _stats_key(layer, "sum") not in self.query_stats:
            raise TableError(f"the table holds no query statistics for layer {layer} "
                             f"(layers 0..{self.num_layers - 1}); recalibrate to get them")
        try:
            return QueryStats.from_tensors(self.query_stats, prefix=prefix)
        except MoendError as e:
            raise TableError(f"query statistics of layer {layer} are invalid: {e}") from None

    def check_model(self, model_or_fingerprint: Any) -> None:
        """Raise :class:`TableError` naming the field if this table was calibrated for another model."""
        fp = (model_or_fingerprint if isinstance(model_or_fingerprint, ModelFingerprint)
              else ModelFingerprint.from_model(model_or_fingerprint))
        msg = self.fingerprint.mismatch(fp, "sensitivity table")
        if msg:
            raise TableError(msg + "; calibrate a table for this model (moend calibrate)")

    def summary(self) -> dict[str, Any]:
        """JSON-ready facts: shape, model, calibration, min/max, the paper's spread columns."""
        return {
            "layers": self.num_layers, "configs": len(self.grid), "grid": self.grid.to_dict(),
            "model": self.fingerprint.to_dict(), "group_size": self.group_size,
            "calibration": self.calibration, "S_min": float(self.S.min()), "S_max": float(self.S.max()),
        }

    # -- save / load ----------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, np.ndarray]:
        out = {"S": np.ascontiguousarray(self.S, dtype=np.float64)}
        if self.gain is not None:
            out["gain"] = np.ascontiguousarray(self.gain, dtype=np.float64)
        for k, v in self.query_stats.items():
            out[k if k.startswith(STATS_PREFIX) else STATS_PREFIX + k] = np.ascontiguousarray(v)
        return out

    def _meta(self) -> dict[str, Any]:
        return {"grid": self.grid.to_dict(), "model": self.fingerprint.to_dict(),
                "group_size": self.group_size, "calibration": self.calibration}

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        tensors = self._tensors()
        try:
            meta_json = json.dumps(self._meta(), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TableError(f"calibration settings are not JSON-serialisable: {e}") from None
        metadata = {"format": TABLE_FORMAT, "version": str(TABLE_FORMAT_VERSION), "meta": meta_json,
                    "sha256": _digest(tensors, meta_json)}
        return save(tensors, metadata=metadata)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table atomically (temp file + rename) as safetensors with JSON metadata."""
        return atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "table") -> SensitivityTable:
        from safetensors import SafetensorError
        from safetensors.numpy import load

        metadata = _read_metadata(data, where)
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, OSError) as e:
            raise TableError(f"{where} is not a valid safetensors file (truncated or corrupted?): {e}") from None
        if metadata.get("format") != TABLE_FORMAT:
            raise TableError(f"{where}: format={metadata.get('format')!r} is not a sensitivity table; "
                             f"expected {TABLE_FORMAT!r}")
        if metadata.get("version") != str(TABLE_FORMAT_VERSION):
            raise TableError(f"{where}: table version={metadata.get('version')!r} is unsupported; "
                             f"allowed: [{TABLE_FORMAT_VERSION}]")
        if metadata.get("sha256") != _digest(tensors, metadata.get("meta", "")):
            raise TableError(f"{where}: tensors and metadata do not match the stored sha256 (the file was "
                             "modified or corrupted); recalibrate or restore it")
        try:
            meta = json.loads(metadata.get("meta", ""))
        except json.JSONDecodeError as e:
            raise TableError(f"{where}: metadata 'meta' is not valid JSON: {e.msg}") from None
        if not isinstance(meta, dict):
            raise TableError(f"{where}: metadata 'meta' must be a JSON object")
        missing = [k for k in ("grid", "model", "group_size", "calibration") if k not in meta]
        if missing:
            raise TableError(f"{where}: metadata is missing field(s) {missing}")
        try:
            grid = Grid.from_dict(meta["grid"])
            fp = ModelFingerprint.from_dict(meta["model"])
        except PlanError as e:
            raise TableError(f"{where}: {e}") from None
        if "S" not in tensors:
            raise TableError(f"{where}: no tensor 'S'; present: {sorted(tensors)[:8]}")
        if tensors["S"].dtype != np.float64:
            raise TableError(f"{where}: S has dtype {tensors['S'].dtype}; expected float64")
        if not isinstance(meta["calibration"], dict):
            raise TableError(f"{where}: calibration must be an object")
        gain = tensors.get("gain")
        if gain is not None and gain.dtype != np.float64:
            raise TableError(f"{where}: gain has dtype {gain.dtype}; expected float64")
        stats = {k: v for k, v in tensors.items() if k not in ("S", "gain")}
        _check_stats(stats, fp, where)
        table = cls(S=tensors["S"], grid=grid, fingerprint=fp, group_size=meta["group_size"],
                    calibration=meta["calibration"], query_stats=stats, gain=gain)
        return table

    @classmethod
    def load(cls, path: str | os.PathLike) -> SensitivityTable:
        """Read and validate a table; every problem is a :class:`TableError`."""
        data = read_existing(path, "sensitivity table", TableError, "create one with `moend calibrate`")
        where = f"table {str(Path(path))!r}"
        try:
            return cls.from_bytes(data, where=where)
        except TableError:
            raise
        except MoendError as e:  # a field that parses but is out of range
            raise TableError(f"{where}: {e}") from None


def _digest(tensors: dict[str, np.ndarray], meta_json: str) -> str:
    """sha256 over the ``meta`` JSON and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(meta_json.encode("utf-8"))
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _read_metadata(data: bytes, where: str) -> dict[str, str]:
    """The safetensors header's ``__metadata__``; TableError if the header itself is damaged."""
    if len(data) < 8:
        raise TableError(f"{where} is truncated: {len(data)} bytes, not even a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise TableError(f"{where} is truncated or not a safetensors file: header of {n} bytes, file of "
                         f"{len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TableError(f"{where}: the safetensors header is not valid JSON (corrupted file)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise TableError(f"{where} has no metadata; it was not written by moend_fx (format {TABLE_FORMAT!r})")
    return meta
