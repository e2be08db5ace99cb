"""What a calibration is (:class:`CalibrationSettings`, stored in a table's metadata) and whether a table was made
by this version of it (:func:`stale_reason`): the cache scores tokens with the current defaults, so a table
measured otherwise mis-predicts what eviction costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moend_fx.calibration.gains import RECOMMENDED_PROBE
from moend_fx.common.checks import check_choice, check_int, check_power_of_two
from moend_fx.common.defaults import CALIBRATION_TOKENS, CALIBRATION_WINDOW, GROUP_SIZE, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.common.options import HeadReduce, ScoreCombine, ScorerName, SensitivityMeasure
from moend_fx.eviction.scorers import SCORERS, default_options
from moend_fx.plan.routing import LayerConfig

__all__ = ["CALIBRATION_VERSION", "CalibrationSettings", "scorer_options", "stale_reason"]


CALIBRATION_VERSION = 4
_VERSION_NOTE = ("4: the text sequences end with a retrieval tail (questions about their earlier records), so "
                 "S and the gains rate layers by retrieved facts; 3: per-layer gains on 2 "
                 "sequences by default (the predicted loss is an end-to-end KL); 2: query statistics exclude the "
                 "measured window, S monotone in keep ratio, the cache's keep floor")


@dataclass(frozen=True)
class CalibrationSettings:
    """How a table was calibrated (stored in the table's metadata).

    window: the last queries whose attention error is measured (the scorer itself reads the cache's query window,
    ``moend_fx.common.defaults.QUERY_WINDOW``, of them). retrieval_tails: how many text sequences (the first ones)
    end with ``window`` tokens of questions about their earlier records
    (``moend_fx.calibration.data.retrieval_tail``), so their measured queries retrieve facts; the others stay
    plain text (random ids have no records). None (the default): every sequence; 0: none
    (docs/calibration.md, "Calibration text", for what each costs). gain_probe: the config name whose one-layer KL sets
    per-layer gains (:mod:`moend_fx.calibration.gains`; any config), or None for the paper's ``sum S``.
    measure: what S measures (:class:`~moend_fx.common.options.SensitivityMeasure`); ``top1`` sees no V error
    (values do not choose the winning key), so a grid's V bits all cost alike there."""

    tokens: int = CALIBRATION_TOKENS
    num_sequences: int = 2
    seed: int = 0
    scorer: ScorerName = ScorerName.TRIG
    window: int = CALIBRATION_WINDOW
    group_size: int = GROUP_SIZE
    sink_tokens: int = SINK_TOKENS
    recent_tokens: int = RECENT_TOKENS
    retrieval_tails: int | None = None
    gain_probe: str | None = RECOMMENDED_PROBE
    measure: SensitivityMeasure = SensitivityMeasure.L2

    def __post_init__(self) -> None:
        for name in ("tokens", "num_sequences", "window"):
            check_int(name, getattr(self, name))
        for name in ("sink_tokens", "recent_tokens", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        check_power_of_two("group_size", self.group_size)
        if self.retrieval_tails is not None:
            check_int("retrieval_tails", self.retrieval_tails, minimum=0)
            if self.retrieval_tails > self.num_sequences:
                raise MoendError(f"retrieval_tails={self.retrieval_tails} is invalid with num_sequences="
                                 f"{self.num_sequences}; allowed: 0 to {self.num_sequences}")
        object.__setattr__(self, "scorer", check_choice("scorer", self.scorer, ScorerName))
        object.__setattr__(self, "measure", check_choice("measure", self.measure, SensitivityMeasure))
        if self.gain_probe is not None:
            probe = LayerConfig.from_name(self.gain_probe, "gain_probe")
            if probe.lossless:
                raise MoendError(f"gain_probe={self.gain_probe!r} is lossless; it must evict or quantize "
                                 "(e.g. keep0.5_k4_v4), or be None for no gains")
            object.__setattr__(self, "gain_probe", probe.name)

    @property
    def probe(self) -> LayerConfig | None:
        return None if self.gain_probe is None else LayerConfig.from_name(self.gain_probe)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def scorer_options(name: str) -> dict[str, Any]:
    """The options (JSON-ready) this version builds scorer ``name`` with: recorded in a table, so a table
    calibrated with another version of the scorer is recognised (:func:`stale_reason`). Needs no RoPE or stats."""
    return default_options(name)


OPTIONS_BEFORE_RECORDED: dict[str, Any] = {"head_reduce": HeadReduce.MEAN, "combine": ScoreCombine.SUM}
"""Scorer options added after tables recorded their options, at the behaviour the scorer had before them: a table
that does not record one was calibrated that way (whatever the option's default is now)."""


def stale_reason(table: Any) -> str | None:
    """Why ``table`` was calibrated by an older calibration (:data:`CALIBRATION_VERSION`) or with other scorer
    options than this version's defaults (None if current). An option the table does not record counts at its
    value in :data:`OPTIONS_BEFORE_RECORDED` (what the scorer did before the option existed).

    The cache scores tokens with the current defaults, so a table measured with older ones mis-predicts
    what eviction costs: recalibrate it (``moend calibrate``)."""
    cal = table.calibration
    if cal.get("version", 1) != CALIBRATION_VERSION:
        return (f"the table was made by calibration version {cal.get('version', 1)}, this version makes "
                f"{CALIBRATION_VERSION} ({_VERSION_NOTE}); recalibrate it with `moend calibrate`")
    name = str(cal.get("scorer", ScorerName.TRIG))
    if name not in SCORERS:
        return None
    want = scorer_options(name)
    got = cal.get("scorer_options")
    if isinstance(got, dict):  # a table older than an option was calibrated at the behaviour before it
        got = {**{k: v for k, v in OPTIONS_BEFORE_RECORDED.items() if k in want and k not in got}, **got}
    if got != want:
        return (f"the table was calibrated with {name} scorer options {got}, this version uses {want}; "
                "recalibrate it with `moend calibrate`")
    return None
