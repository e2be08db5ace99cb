"""Closed option sets as ``StrEnum`` (a member compares equal to its name, so JSON, argparse and keyword
arguments keep taking plain strings). Open sets (solvers, scorers, tasks) are registries, not enums."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


class ScorerName(StrEnum):
    """Eviction scorers a plan may name (``moend_fx.eviction.scorers`` registers one class per name)."""

    TRIG = "trig"
    SNAPKV = "snapkv"
    KEYNORM = "keynorm"
    STREAMING = "streaming"
    H2O = "h2o"


class BudgetMode(StrEnum):
    """How a cache layer bounds what it holds: ``ratio`` of the tokens seen, or a fixed token ``capacity``."""

    RATIO = "ratio"
    CAPACITY = "capacity"


class QuantMode(StrEnum):
    """Which axis a quantization group runs along: ``channel`` (K: groups of tokens per channel) or ``token``
    (V: groups of channels per token)."""

    CHANNEL = "channel"
    TOKEN = "token"


class Pooling(StrEnum):
    """How a scorer smooths per-token scores over neighbouring stored tokens."""

    MAX = "max"
    AVG = "avg"
    NONE = "none"


class Kernel(StrEnum):
    """Which implementation runs the fused packed attention op."""

    AUTO = "auto"
    CPU = "cpu"
    TRITON = "triton"
    REFERENCE = "reference"


class InnerCompiler(StrEnum):
    """The compiler the ``moend`` backend hands the rewritten graph to."""

    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"


class Setting(StrEnum):
    """When compression happens relative to the question (see docs/evaluation.md)."""

    QUERY_AWARE = "query_aware"
    QUERY_AGNOSTIC = "query_agnostic"
