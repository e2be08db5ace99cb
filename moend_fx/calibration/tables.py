"""Where sensitivity tables live and how a table is named on the command line.

One definition of the cached table's path (``$MOEND_CACHE/tables/<model>-<scorer>-<tokens>.safetensors``, what
``moend calibrate`` writes and ``moend generate``, ``moend eval`` and ``moend bench`` read), of a table spec
(a file, or ``synthetic:LAYERS[:SEED]`` for a paper-shaped synthetic table) and of the context length a plan is
solved for when none is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.defaults import CALIBRATION_TOKENS, DEFAULT_MODEL
from moend_fx.common.errors import TableError
from moend_fx.common.options import ScorerName

SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_TABLE_HINT = f"$MOEND_CACHE/tables/<model>-{ScorerName.TRIG}-{CALIBRATION_TOKENS}.safetensors"
"""The default table's path as help texts name it."""


def default_table_path(model: str = DEFAULT_MODEL, tokens: int = CALIBRATION_TOKENS, *,
                       scorer: str = ScorerName.TRIG) -> Path:
    """``$MOEND_CACHE/tables/<model>-<scorer>-<tokens>.safetensors``; ``<model>`` is the last part of the model
    name or folder, lower-cased (``HuggingFaceTB/SmolLM2-135M`` and ``./SmolLM2-135M`` share one table)."""
    from moend_fx.models import cache_root

    return cache_root() / "tables" / f"{Path(model).name.lower()}-{scorer}-{tokens}.safetensors"


def load_table(spec: str) -> SensitivityTable:
    """A table from a file, or ``synthetic:LAYERS[:SEED]`` (demos and tests; see ``moend_fx.solvers.synthetic``)."""
    if spec.startswith(SYNTHETIC_PREFIX):
        # Imported here: synthetic tables are built by the solvers' study tools, a later stage than this one.
        from moend_fx.solvers.synthetic import synthetic_table

        parts = spec.split(":")[1:]
        try:
            layers = int(parts[0])
            seed = int(parts[1]) if len(parts) > 1 else 0
            if layers <= 0 or len(parts) > 2:
                raise ValueError
        except (ValueError, IndexError):
            raise TableError(f"table {spec!r} is invalid; allowed: a file or 'synthetic:LAYERS[:SEED]' "
                             "(e.g. 'synthetic:30:0')") from None
        return synthetic_table(layers, seed=seed)
    if not Path(spec).exists():
        raise TableError(f"table file {spec!r} does not exist; give a file or 'synthetic:LAYERS[:SEED]'")
    return SensitivityTable.load(spec)


def require_table(path: str | Path) -> SensitivityTable:
    """The table at ``path``; a missing file is a :class:`TableError` that says how to make one."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"sensitivity table {str(path)!r} not found; run `moend calibrate` first or pass "
                         "--table PATH")
    return SensitivityTable.load(path)


def table_context_length(table: SensitivityTable, given: int | None = None) -> int:
    """The context length to solve ``table`` for: ``given``, else the table's calibration length, else
    :data:`~moend_fx.common.defaults.CALIBRATION_TOKENS`."""
    if given is not None:
        return given
    return int(table.calibration.get("context_length") or CALIBRATION_TOKENS)


def layer_query_stats(table: SensitivityTable) -> list[Any] | None:
    """The calibrated per-layer :class:`~moend_fx.eviction.rope.QueryStats` of ``table`` (None if it has none),
    in the form a ``MoENDCache`` takes as ``query_stats``."""
    if not table.has_stats():
        return None
    return [table.layer_stats(layer) for layer in range(table.num_layers)]
