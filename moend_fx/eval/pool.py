"""Pool the records of several evaluation runs into one report (``moend report``).

    >>> pooled = pool_runs(["results/eval-8k", "results/eval-seed1-8k"])
    >>> write_report(pooled.records, "results/pooled-8k", meta=pooled.meta)

A run is a folder written by ``moend eval`` (its ``results.json``, or its ``records.jsonl`` while the run is
unfinished) or a ``results.json`` itself. Runs of different seeds draw different examples, so pooling them is
how a cell gets more than one run's n: an example is (task, seed, index) (:mod:`moend_fx.eval.paired`), and a
record made before records carried their seed takes it from its run's ``meta.config.seed``.

Pooling refuses what would mix unlike things, with an error naming the runs and the field:

- runs on different models, or whose configs differ in anything that changes a method's answer (scorer,
  re-eviction, budget mode, query window, generation limits: ``BEHAVIOUR_FIELDS``), or that planned a setting on
  tables of another recipe (calibration length, scorer, version: ``TABLE_FIELDS``); fields a run's meta lacks
  (a run made before the field existed) are not compared;
- the same run (setting, length, example, method, budget) from two runs with different results. The same result
  twice (a run whose ``full`` records were copied from another's) is kept once and counted in
  ``meta["pooled"]["duplicates"]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.eval.records import load_records
from moend_fx.eval.summary import budget_key

BEHAVIOUR_FIELDS = ("max_new_tokens", "tokens_per_answer", "window", "evict_every", "scorer", "calibrated_stats",
                    "reevict", "budget_mode")
"""Config fields whose values must agree across pooled runs: each changes what a method answers."""

TABLE_FIELDS = ("context_length", "tokens", "num_sequences", "version", "scorer", "scorer_options", "measure",
                "gain_probe", "retrieval_tails")
"""Fields of a setting's table (``meta.settings.<setting>.table``) that must agree: which table planned the
methods. Its measured values are not compared (two calibrations of one recipe differ by float rounding)."""

RUN_KEY = ("setting", "target_length", "task", "seed", "index", "method", "budget")
"""What makes a record one run of one example."""

_SAME = ("score", "generated", "measured_bytes")  # a repeated run with these equal is the same result


@dataclass(frozen=True)
class Pooled:
    """Records pooled from several runs and the report's meta (the first run's model and table, its config
    widened to every run's tasks, lengths, seeds and methods, and ``meta["pooled"]``: each source's path, seed
    and record count, and how many repeats were dropped)."""

    records: list[dict[str, Any]]
    meta: dict[str, Any]


def read_run(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    """(records, meta, the file read) of one run: a results.json, or a folder holding one (else its
    records.jsonl, whose records must then name their seed)."""
    p = Path(path)
    if p.is_dir():
        if (p / "results.json").is_file():
            p = p / "results.json"
        elif (p / "records.jsonl").is_file():
            p = p / "records.jsonl"
        else:
            raise MoendError(f"{path} holds neither results.json nor records.jsonl: is it a 'moend eval --out' "
                             "folder?")
    elif not p.is_file():
        raise MoendError(f"{path} does not exist; pass 'moend eval --out' folders or their results.json")
    if p.suffix == ".jsonl":
        records = load_records(p, tuple(k for k in RUN_KEY if k != "seed"), restart="pass its results.json")
        unseeded = sum(isinstance(r, dict) and "seed" not in r for r in records)
        if unseeded:
            raise MoendError(f"{p}: {unseeded} records name no seed (made before records carried one) and there is "
                             "no results.json beside them to read it from; let the run finish, or pass its "
                             "results.json")
        return _checked(records, p), {}, p
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise MoendError(f"{p} is not JSON ({e.msg}); is it a moend eval results.json?") from None
    if not isinstance(doc, dict) or doc.get("format") != "moend_fx.eval":
        raise MoendError(f"{p} is not a moend_fx.eval results file (format "
                         f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    meta = doc.get("meta") or {}
    seed = (meta.get("config") or {}).get("seed")
    records = [r if not isinstance(r, dict) or "seed" in r else {**r, "seed": seed} for r in doc.get("records", [])]
    return _checked(records, p), meta, p


def _checked(records: list[Any], path: Path) -> list[dict[str, Any]]:
    """``records``, each a dict holding every ``RUN_KEY`` field (else a MoendError naming the record)."""
    for i, r in enumerate(records, 1):
        missing = [k for k in RUN_KEY if not isinstance(r, dict) or k not in r]
        if missing:
            raise MoendError(f"{path}: record {i} lacks {', '.join(missing)}: not a moend eval record")
    return records


def pool_runs(paths: Sequence[str | Path], methods: Iterable[str] | None = None,
              lengths: Iterable[int] | None = None) -> Pooled:
    """Pool the runs at ``paths`` (see the module docstring); ``methods`` / ``lengths``: keep only these methods'
    records / the records of these target lengths (a run that covers more lengths than another pools with it on
    the ones they share)."""
    if not paths:
        raise MoendError("nothing to pool: pass one or more 'moend eval --out' folders")
    keep = None if methods is None else set(methods)
    keep_len = None if lengths is None else {int(n) for n in lengths}
    runs = [read_run(p) for p in paths]
    _check_alike([(str(f), meta) for _, meta, f in runs])
    held = {r["method"] for recs, _, _ in runs for r in recs}
    if keep is not None and keep - held:
        raise MoendError(f"no run holds method(s) {', '.join(sorted(keep - held))}; these runs hold "
                         f"{', '.join(sorted(held))}")
    held_len = {r["target_length"] for recs, _, _ in runs for r in recs}
    if keep_len is not None and keep_len - held_len:
        raise MoendError(f"no run holds length(s) {', '.join(map(str, sorted(keep_len - held_len)))}; these runs "
                         f"hold {', '.join(map(str, sorted(held_len)))}")
    seen: dict[tuple, tuple[dict[str, Any], str]] = {}
    records: list[dict[str, Any]] = []
    duplicates = 0
    for recs, _, f in runs:
        for r in recs:
            if (keep is not None and r["method"] not in keep) or (keep_len is not None
                                                                  and r["target_length"] not in keep_len):
                continue
            key = tuple(r.get(k) for k in RUN_KEY)
            if key in seen:
                first, where = seen[key]
                if any(first.get(k) != r.get(k) for k in _SAME):
                    raise MoendError(
                        f"{f} and {where} both hold {_describe(key)} with different results "
                        f"({first.get('generated')!r} vs {r.get('generated')!r}): the same example run twice "
                        "with different code or tables; pool one of them (--methods to leave a method out)")
                duplicates += 1
                continue
            seen[key] = (r, str(f))
            records.append(r)
    if not records:
        raise MoendError(f"no records to pool in {', '.join(map(str, paths))}")
    return Pooled(records, _meta(runs, records, duplicates))


def _describe(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(RUN_KEY, key))


def _check_alike(metas: list[tuple[str, dict[str, Any]]]) -> None:
    """A MoendError when two runs are on different models or differ in a ``BEHAVIOUR_FIELDS`` value."""
    first_path, first = metas[0]
    for path, meta in metas[1:]:
        a, b = first.get("model"), meta.get("model")
        if a and b and a != b:
            raise MoendError(f"{path} is on another model than {first_path} ({b} vs {a}): pool runs of one model")
        ca, cb = first.get("config") or {}, meta.get("config") or {}
        for k in BEHAVIOUR_FIELDS:
            if k in ca and k in cb and ca[k] != cb[k]:
                raise MoendError(f"{path} ran with {k}={cb[k]!r} and {first_path} with {k}={ca[k]!r}: pooled runs "
                                 f"must agree on {', '.join(BEHAVIOUR_FIELDS)}")
        sa, sb = first.get("settings") or {}, meta.get("settings") or {}
        for setting in sorted(set(sa) & set(sb)):
            ta, tb = (sa[setting] or {}).get("table") or {}, (sb[setting] or {}).get("table") or {}
            for k in TABLE_FIELDS:
                if k in ta and k in tb and _differ(ta[k], tb[k]):
                    raise MoendError(f"{path} planned {setting} on a table with {k}={tb[k]!r} and {first_path} on "
                                     f"one with {k}={ta[k]!r}: pooled runs must plan on tables of one recipe")


def _differ(a: Any, b: Any) -> bool:
    """Whether two recorded values disagree; of two dicts (scorer options) only the keys both record count: an
    option added later is recorded only by tables made after it, which count an older table at its default."""
    if isinstance(a, dict) and isinstance(b, dict):
        return any(a[k] != b[k] for k in set(a) & set(b))
    return a != b


def _meta(runs: list[tuple[list[dict[str, Any]], dict[str, Any], Path]], records: list[dict[str, Any]],
          duplicates: int) -> dict[str, Any]:
    base = next((m for _, m, _ in runs if m), {})
    config = dict(base.get("config") or {})
    seeds = sorted({r["seed"] for r in records}, key=repr)
    tasks = sorted({r["task"] for r in records})
    lengths = sorted({r["target_length"] for r in records})
    per_cell: dict[tuple, set] = {}
    for r in records:
        per_cell.setdefault((r["task"], r["target_length"]), set()).add((r["seed"], r["index"]))
    ns = sorted({len(v) for v in per_cell.values()})
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None}, key=budget_key)
    config.update(tasks=tasks, lengths=lengths, seeds=seeds, n="/".join(map(str, ns)), budgets=budgets,
                  methods=sorted({r["method"] for r in records}), settings=sorted({r["setting"] for r in records}))
    config.pop("seed", None)
    return dict(base, config=config, pooled=dict(
        sources=[dict(path=str(f), seed=(m.get("config") or {}).get("seed"), records=len(recs))
                 for recs, m, f in runs],
        duplicates=duplicates))
