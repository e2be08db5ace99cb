"""Closed option sets as ``StrEnum`` (a member compares equal to its name, so JSON, argparse and keyword
arguments keep taking plain strings). Open sets (solvers, scorers, tasks) are registries, not enums.

Each set is one :func:`option_set` call: ``Kernel.CPU == "cpu"``, ``list(Kernel)`` in declaration order."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


def option_set(name: str, doc: str, *values: str, module: str = __name__) -> type[StrEnum]:
    """A StrEnum ``name`` whose members are ``values`` (member names upper-cased), documented by ``doc``."""
    cls = StrEnum(name, [(v.upper(), v) for v in values], module=module)
    cls.__doc__ = doc
    return cls


ScorerName = option_set(
    "ScorerName", "Eviction scorers a plan may name (``moend_fx.eviction.scorers`` registers one class per name).",
    "trig", "snapkv", "snapkv_trig", "keynorm", "streaming", "h2o")
BudgetMode = option_set(
    "BudgetMode", "How a cache layer bounds what it holds: ``ratio`` of the tokens seen, or a fixed token "
    "``capacity``.", "ratio", "capacity")
ReEviction = option_set(
    "ReEviction", "What a re-eviction of a packed layer drops: whole packed ``groups`` (every kept code, scale and "
    "zero bit for bit) or single ``tokens`` (the lowest-ranked ones; survivors re-quantized).", "groups", "tokens")
QuantMode = option_set(
    "QuantMode", "Which axis a quantization group runs along: ``channel`` (K: groups of tokens per channel) or "
    "``token`` (V: groups of channels per token).", "channel", "token")
Pooling = option_set(
    "Pooling", "How a scorer smooths per-token scores over neighbouring stored tokens.", "max", "avg", "none")
HeadReduce = option_set(
    "HeadReduce", "How an attention-reading scorer folds the query heads of one KV group into the group's score: "
    "their ``mean`` or their ``max`` (a token one head attends to sharply counts fully).", "mean", "max")
ScoreCombine = option_set(
    "ScoreCombine", "How the query-aware scorer joins its two standardised scores: their weighted ``sum``, or their "
    "``max`` (a token either score ranks high is kept).", "sum", "max")
Kernel = option_set(
    "Kernel", "Which implementation runs the fused packed attention op.", "auto", "cpu", "triton", "reference")
InnerCompiler = option_set(
    "InnerCompiler", "The compiler the ``moend`` backend hands the rewritten graph to (``auto``: chosen per device "
    "from measurements, ``moend_fx.compile.settings.AUTO_INNER``).",
    "auto", "inductor", "aot_eager", "eager")
SensitivityMeasure = option_set(
    "SensitivityMeasure", "What a sensitivity table's S measures per layer and config over the calibration window's "
    "queries: ``l2``, the attention output's relative L2 error (the paper's), or ``top1``, the share of (query, "
    "head) rows whose most-attended key under compression is not the one at full precision (what a retrieval "
    "needs: the fact's key winning a sharp softmax).", "l2", "top1")
Setting = option_set(
    "Setting", "When compression happens relative to the question (see docs/evaluation.md).",
    "query_aware", "query_agnostic")
