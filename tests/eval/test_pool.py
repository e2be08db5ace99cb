"""Pooling evaluation runs: seeds from the run's meta, duplicates, refusals that name the runs and the field."""

from __future__ import annotations

import json

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.eval.pool import pool_runs, read_run
from moend_fx.eval.report import write_report

MODEL = dict(architecture="LlamaForCausalLM", num_layers=30, num_kv_heads=3, head_dim=64)
CONFIG = dict(tasks=["niah_single"], lengths=[2048], n=3, budgets=["14x"], methods=["full", "2d_hetero"],
              settings=["query_aware"], max_new_tokens=24, window=32, reevict="groups", budget_mode="capacity")


def _rec(method, budget, idx, score, generated=None):
    """A record as runs before 2026-12-07 wrote it: no seed field."""
    return dict(task="niah_single", target_length=2048, index=idx, setting="query_aware", method=method,
                budget=budget, score=score, generated=generated or (" 123456." if score else " 11."),
                measured_bytes=3_000_000 if budget else 93_000_000, context_tokens=2040, full16_bytes=46_000_000,
                full_model_bytes=92_000_000, budget_bytes=3_200_000 if budget else None,
                ratio16=46 / 3 if budget else 0.5, ratio_model=92 / 3 if budget else 1.0)


def _run(path, seed, records, model=MODEL, **config):
    path.mkdir(parents=True, exist_ok=True)
    doc = dict(format="moend_fx.eval", version=1, meta=dict(model=model, config=dict(CONFIG, seed=seed, **config)),
               summary=[], records=records)
    (path / "results.json").write_text(json.dumps(doc))
    return path


def _both(scores_full, scores_ours):
    return ([_rec("full", None, i, s) for i, s in enumerate(scores_full)]
            + [_rec("2d_hetero", "14x", i, s) for i, s in enumerate(scores_ours)])


def test_two_seeds_pool_into_twice_the_examples_paired_apart(tmp_path):
    a = _run(tmp_path / "s0", 0, _both([1, 1, 0], [1, 0, 0]))
    b = _run(tmp_path / "s1", 1, _both([1, 1, 1], [1, 1, 0]))
    pooled = pool_runs([a, b])
    assert len(pooled.records) == 12 and {r["seed"] for r in pooled.records} == {0, 1}
    cfg = pooled.meta["config"]
    assert cfg["seeds"] == [0, 1] and cfg["n"] == "6" and "seed" not in cfg
    assert [s["seed"] for s in pooled.meta["pooled"]["sources"]] == [0, 1]
    paths = write_report(pooled.records, tmp_path / "out", meta=pooled.meta)
    doc = json.loads(paths["json"].read_text())
    row = next(r for r in doc["paired"] if r["method"] == "2d_hetero")
    assert (row["n"], row["better"], row["worse"]) == (6, 0, 2)
    md = paths["md"].read_text()
    assert "seeds 0, 1" in md and "Paired with `full`" in md and "| 6 | 50.0 | 83.3 | -33.3" in md


def test_a_result_repeated_in_two_runs_is_kept_once(tmp_path):
    full = [_rec("full", None, i, 1.0) for i in range(3)]
    a = _run(tmp_path / "a", 0, full + [_rec("2d_hetero", "14x", i, 1.0) for i in range(3)])
    b = _run(tmp_path / "b", 0, full + [_rec("lossless", None, i, 1.0) for i in range(3)])  # full copied over
    pooled = pool_runs([a, b])
    assert len(pooled.records) == 9 and pooled.meta["pooled"]["duplicates"] == 3


def test_the_same_run_with_another_answer_is_refused_naming_both_runs(tmp_path):
    a = _run(tmp_path / "a", 0, [_rec("full", None, 0, 1.0)])
    b = _run(tmp_path / "b", 0, [_rec("full", None, 0, 0.0)])
    with pytest.raises(MoendError, match=r"b/results.json and .*a/results.json both hold .*index=0.*different"):
        pool_runs([a, b])


@pytest.mark.parametrize("field, value", [("reevict", "tokens"), ("budget_mode", "ratio"), ("window", 64)])
def test_runs_that_answer_differently_by_config_are_refused(tmp_path, field, value):
    a = _run(tmp_path / "a", 0, _both([1], [1]))
    b = _run(tmp_path / "b", 1, _both([1], [0]), **{field: value})
    with pytest.raises(MoendError, match=f"ran with {field}={value!r}"):
        pool_runs([a, b])


def test_a_field_an_older_run_lacks_is_not_compared_but_another_model_is_refused(tmp_path):
    a = _run(tmp_path / "a", 0, _both([1], [1]))
    old = dict(CONFIG, seed=1)
    del old["reevict"]
    b = tmp_path / "b"
    b.mkdir()
    (b / "results.json").write_text(json.dumps(dict(format="moend_fx.eval", meta=dict(model=MODEL, config=old),
                                                    records=_both([1], [1]))))
    assert len(pool_runs([a, b]).records) == 4
    c = _run(tmp_path / "c", 2, _both([1], [1]), model=dict(MODEL, num_layers=24))
    with pytest.raises(MoendError, match="another model"):
        pool_runs([a, c])


def test_methods_filter_and_an_unknown_method(tmp_path):
    a = _run(tmp_path / "a", 0, _both([1, 0], [1, 1]))
    assert {r["method"] for r in pool_runs([a], methods=["full"]).records} == {"full"}
    with pytest.raises(MoendError, match="no run holds method.s. pyramid; these runs hold 2d_hetero, full"):
        pool_runs([a], methods=["full", "pyramid"])


def test_an_unfinished_run_pools_from_records_that_name_their_seed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [dict(_rec("full", None, 0, 1.0), seed=3), dict(_rec("2d_hetero", "14x", 0, 0.0), seed=3)]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records, meta, path = read_run(run)
    assert [r["seed"] for r in records] == [3, 3] and meta == {} and path.name == "records.jsonl"
    (run / "records.jsonl").write_text(json.dumps(_rec("full", None, 0, 1.0)) + "\n")
    with pytest.raises(MoendError, match="1 records name no seed"):
        read_run(run)


@pytest.mark.parametrize("make, match", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "neither results.json nor records.jsonl"),
    (lambda p: (p.mkdir(), (p / "results.json").write_text('{"format": "other"}')), "not a moend_fx.eval"),
    (lambda p: (p.mkdir(), (p / "results.json").write_text("{oops")), "is not JSON"),
    (lambda p: (p.mkdir(), (p / "records.jsonl").write_text("{oops\n")), r"records.jsonl:1 is not a JSON record"),
    (lambda p: (p.mkdir(), (p / "results.json").write_text(json.dumps(
        dict(format="moend_fx.eval", meta={}, records=[{"task": "passkey"}])))),
     "record 1 lacks setting, target_length"),
])
def test_what_is_not_a_run_is_a_clear_error(tmp_path, make, match):
    make(tmp_path / "run")
    with pytest.raises(MoendError, match=match):
        pool_runs([tmp_path / "run"])
    with pytest.raises(MoendError, match="nothing to pool"):
        pool_runs([])


def test_runs_planned_on_tables_of_another_recipe_are_refused(tmp_path):
    def table(tokens, probe, options):
        return dict(query_aware=dict(table=dict(tokens=tokens, context_length=tokens, version=4,
                                                scorer_options=options, gains=dict(probe_S=[probe]))))
    a = _run(tmp_path / "a", 0, _both([1], [1]))
    b = _run(tmp_path / "b", 1, _both([1], [1]))
    c = _run(tmp_path / "c", 2, _both([1], [0]))
    older = {"kernel_size": 9}  # made before the option head_reduce existed: counted at its default
    for path, tokens, probe, options in ((a, 2048, 0.11, dict(older, head_reduce="mean")), (b, 2048, 0.1100001, older),
                                         (c, 8192, 0.3, older)):
        doc = json.loads((path / "results.json").read_text())
        doc["meta"]["settings"] = table(tokens, probe, options)
        (path / "results.json").write_text(json.dumps(doc))
    assert len(pool_runs([a, b]).records) == 4  # one recipe: measured values may differ by rounding
    with pytest.raises(MoendError, match="planned query_aware on a table with context_length=8192 .* "
                                         "context_length=2048"):
        pool_runs([a, c])


def test_lengths_filter_pools_the_lengths_runs_share_and_names_a_missing_one(tmp_path):
    long = [dict(r, target_length=4096) for r in _both([1, 1], [0, 1])]
    a = _run(tmp_path / "a", 0, _both([1, 0], [1, 1]) + long)  # 2k and 4k
    b = _run(tmp_path / "b", 1, _both([1, 1], [1, 1]))  # 2k only
    pooled = pool_runs([a, b], lengths=[2048])
    assert {r["target_length"] for r in pooled.records} == {2048} and len(pooled.records) == 8
    assert pooled.meta["config"]["lengths"] == [2048]
    assert len(pool_runs([a, b]).records) == 12
    with pytest.raises(MoendError, match="no run holds length.s. 7900; these runs hold 2048, 4096"):
        pool_runs([a, b], lengths=[2048, 7900])
