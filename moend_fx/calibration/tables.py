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
from moend_fx.common.errors import MoendError, TableError
from moend_fx.common.options import ScorerName

SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_TABLE_HINT = f"$MOEND_CACHE/tables/<model>-{ScorerName.TRIG}-{CALIBRATION_TOKENS}.safetensors"
"""The default (query-agnostic) table's path as help texts name it."""
SETTING_TABLES_HINT = (f"each setting's own, $MOEND_CACHE/tables/<model>-<scorer>-{CALIBRATION_TOKENS}.safetensors "
                       f"with scorer {ScorerName.SNAPKV_TRIG} (query_aware) or {ScorerName.TRIG} (query_agnostic)")
"""The per-setting default tables as help texts name them."""


def default_table_path(model: str = DEFAULT_MODEL, tokens: int = CALIBRATION_TOKENS, *,
                       scorer: str = ScorerName.TRIG) -> Path:
    """``$MOEND_CACHE/tables/<model>-<scorer>-<tokens>.safetensors``; ``<model>`` is the last part of the model
    name or folder, lower-cased (``HuggingFaceTB/SmolLM2-135M`` and ``./SmolLM2-135M`` share one table)."""
    from moend_fx.models import cache_root

    return cache_root() / "tables" / f"{Path(model).name.lower()}-{scorer}-{tokens}.safetensors"


def setting_table_path(model: str = DEFAULT_MODEL, setting: str = "query_agnostic",
                       tokens: int = CALIBRATION_TOKENS) -> Path:
    """The cached table of ``setting``: calibrated with the scorer that setting compresses with by default
    (``moend calibrate --setting SETTING`` writes it)."""
    from moend_fx.eviction.scorers import default_scorer

    return default_table_path(model, tokens, scorer=default_scorer(setting))


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


def require_table(path: str | Path, setting: str | None = None) -> SensitivityTable:
    """The table at ``path``; a missing file is a :class:`TableError` that says how to make one (the default
    table of ``setting``, when given: ``moend calibrate --setting SETTING``)."""
    path = Path(path)
    if not path.is_file():
        how = "`moend calibrate`" if setting is None else f"`moend calibrate --setting {setting}`"
        raise TableError(f"sensitivity table {str(path)!r} not found; run {how} first or pass --table PATH")
    return SensitivityTable.load(path)


def table_context_length(table: SensitivityTable, given: int | None = None) -> int:
    """The context length to solve ``table`` for: ``given``, else the table's calibration length, else
    :data:`~moend_fx.common.defaults.CALIBRATION_TOKENS`."""
    if given is not None:
        return given
    return int(table.calibration.get("context_length") or CALIBRATION_TOKENS)


def layer_query_stats(table: SensitivityTable) -> list[Any] | None:
    """The calibrated per-layer :class:`~moend_fx.eviction.query_stats.QueryStats` of ``table`` (None if it has none),
    in the form a ``MoENDCache`` takes as ``query_stats``."""
    if not table.has_stats():
        return None
    return [table.layer_stats(layer) for layer in range(table.num_layers)]


def setting_tables(model: str, settings: Any, table: str | Path | None = None,
                   ) -> tuple[dict[str, SensitivityTable], dict[str, Path], list[str]]:
    """(``{setting: table}``, ``{setting: path}``, warnings) for a run of ``settings``: ``table`` for every
    setting, ``"query_aware=PATH,query_agnostic=PATH"`` (per setting; a setting not named keeps its default), or
    each setting's cached default (:func:`setting_table_path`; settings that share a file share one loaded table).
    A default table calibrated with other scorer options than this version's is a TableError; a given one only
    a warning."""
    from moend_fx.calibration.settings import stale_reason

    given = per_setting_paths(table, settings) if table else {}
    paths = {s: given.get(s) or setting_table_path(model, s) for s in settings}
    loaded: dict[Path, SensitivityTable] = {}
    warnings = []
    for s, path in paths.items():
        if path in loaded:
            continue
        loaded[path] = require_table(path, setting=None if s in given else s)
        why = stale_reason(loaded[path])
        if why and s not in given:  # the default tables are ours to keep current
            raise TableError(f"{path}: {why}")
        if why:
            warnings.append(why)
    return {s: loaded[p] for s, p in paths.items()}, paths, warnings


def per_setting_paths(table: str | Path, settings: Any) -> dict[str, Path]:
    """``{setting: path}`` from ``--table``: one path for every setting in ``settings``, or a comma list of
    ``setting=PATH`` (only those settings; each must be one of ``settings``)."""
    text = str(table)
    if "=" not in text:
        return {s: Path(text) for s in settings}
    out: dict[str, Path] = {}
    allowed = [str(s) for s in settings]
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, path = item.partition("=")
        if not sep or not path or name not in allowed:
            raise MoendError(f"--table item {item!r}: expected SETTING=PATH with SETTING one of {', '.join(allowed)} "
                             "(the run's settings), or one path for every setting")
        if name in out:
            raise MoendError(f"--table names setting {name} twice")
        out[name] = Path(path)
    return {s: out[str(s)] for s in settings if str(s) in out}
