"""Eviction scorers, one per module (kvpress style), and the one factory the cache and calibration share.

Every scorer is a frozen dataclass (:class:`~moend_fx.eviction.scorers.base.Scorer`) with one method,
``score(keys, values, *, queries=None, key_positions, query_positions=None) -> [B, Hkv, T] float32`` (higher =
more worth keeping; shapes in ``base``). Which inputs each needs:

=========  ==========================================================================================
trig       keys, key_positions, a RopeSpec; query stats from ``stats=`` (calibrated) or else
           ``queries`` + ``query_positions`` (estimated on the fly)
snapkv     keys, queries; query_positions for causality (None = every key visible to every query)
snapkv_    keys, the prompt's last queries (SnapKV) while the prompt is compressed; afterwards (decode-time
trig       re-eviction) keys, key_positions, a RopeSpec and calibrated stats (trig), no queries
h2o        keys, queries; query_positions as for snapkv
keynorm    keys
streaming  key_positions
=========  ==========================================================================================

Selection (:func:`moend_fx.eviction.selection.select_tokens`) then keeps the sinks, the recent window and the
best scores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moend_fx.common.checks import check_choice
from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.common.options import ScorerName, Setting
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers.base import KeysOnlyScorer, Scorer
from moend_fx.eviction.scorers.h2o import H2OScorer
from moend_fx.eviction.scorers.keynorm import KeyNormScorer
from moend_fx.eviction.scorers.snapkv import SnapKVScorer
from moend_fx.eviction.scorers.snapkv_trig import SnapKVTrigScorer
from moend_fx.eviction.scorers.streaming import StreamingScorer
from moend_fx.eviction.scorers.trig import TrigScorer, geometric_offsets

__all__ = ["DEFAULT_SCORERS", "SCORERS", "H2OScorer", "KeyNormScorer", "KeysOnlyScorer", "Scorer", "SnapKVScorer",
           "SnapKVTrigScorer", "StreamingScorer", "TrigScorer", "build_scorer", "default_options", "default_scorer",
           "geometric_offsets", "get_scorer"]

SCORERS: dict[str, type[Scorer]] = {
    ScorerName.TRIG: TrigScorer,
    ScorerName.SNAPKV: SnapKVScorer,
    ScorerName.SNAPKV_TRIG: SnapKVTrigScorer,
    ScorerName.KEYNORM: KeyNormScorer,
    ScorerName.STREAMING: StreamingScorer,
    ScorerName.H2O: H2OScorer,
}

# The scorer each setting compresses with by default: where the prompt ends with its question (query_aware), what
# its last queries attend to (SnapKV); before any question, trig on calibrated statistics (docs/cache.md, "Scorers")
DEFAULT_SCORERS: dict[str, str] = {Setting.QUERY_AWARE: ScorerName.SNAPKV_TRIG,
                                   Setting.QUERY_AGNOSTIC: ScorerName.TRIG}

# Inputs a layer hands its scorer, not tunable options: left out of the options a table records.
_LAYER_INPUTS = ("rope", "stats", "offsets")


def get_scorer(name: str, **kwargs: Any) -> Scorer:
    """Build a scorer by name; kwargs go to its dataclass, e.g. ``get_scorer("trig", rope=spec, stats=s)``."""
    if name not in SCORERS:
        raise MoendError(f"unknown scorer {name!r}; allowed: {', '.join(sorted(SCORERS))}")
    cls = SCORERS[name]
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise MoendError(f"scorer {name!r} takes no option(s) {bad}; allowed: {allowed}")
    return cls(**kwargs)


def build_scorer(name_or_scorer: str | Scorer, rope: RopeSpec | None = None, stats: QueryStats | None = None,
                 query_window: int = QUERY_WINDOW, **options: Any) -> Scorer:
    """The scorer of one layer, built the same way for the cache and for calibration: what the scorer takes from
    the layer (:meth:`Scorer.layer_options`: trig the RoPE and calibrated ``stats``, snapkv the ``query_window``
    as its observation window), then ``options`` (which win). A :class:`Scorer` instance is returned as is."""
    if isinstance(name_or_scorer, Scorer):
        return name_or_scorer
    if not isinstance(name_or_scorer, str) or name_or_scorer not in SCORERS:
        raise MoendError(f"scorer={name_or_scorer!r} is unknown; allowed: {', '.join(sorted(SCORERS))} "
                         "or a Scorer instance")
    layer = SCORERS[name_or_scorer].layer_options(rope=rope, stats=stats, query_window=query_window)
    return get_scorer(name_or_scorer, **{**layer, **options})


def default_options(name: str, query_window: int = QUERY_WINDOW) -> dict[str, Any]:
    """The options (JSON-ready, no RoPE or stats) :func:`build_scorer` gives scorer ``name`` by default: its
    dataclass defaults with what it takes from a layer with this ``query_window``."""
    cls = SCORERS[name]
    opts = {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.default is not dataclasses.MISSING}
    opts.update(cls.layer_options(rope=None, stats=None, query_window=query_window))
    return {k: v for k, v in opts.items() if k not in _LAYER_INPUTS}


def default_scorer(setting: str) -> str:
    """The scorer ``setting`` ("query_aware" or "query_agnostic") compresses with by default."""
    return str(DEFAULT_SCORERS[check_choice("setting", setting, Setting)])
