"""`moend report`: pools runs into results.{json,md,png}; a path that is not a run is a one-line error."""

import json

from moend_fx.cli import main


def _run(path, seed, scores):
    recs = []
    for i, (full, ours) in enumerate(scores):
        for method, budget, s in (("full", None, full), ("2d_hetero", "14x", ours)):
            recs.append(dict(task="passkey", target_length=2048, index=i, setting="query_agnostic", method=method,
                             budget=budget, score=s, generated=str(s), measured_bytes=3e6, ratio16=15.0,
                             ratio_model=30.0, context_tokens=2040, full16_bytes=4.6e7, full_model_bytes=9.2e7,
                             budget_bytes=None))
    path.mkdir()
    (path / "results.json").write_text(json.dumps(dict(format="moend_fx.eval", meta=dict(config=dict(seed=seed)),
                                                       records=recs)))
    return str(path)


def test_report_pools_two_seeds(tmp_path, capsys):
    a = _run(tmp_path / "a", 0, [(1.0, 1.0), (1.0, 0.0)])
    b = _run(tmp_path / "b", 1, [(0.0, 1.0), (1.0, 1.0)])
    assert main(["report", a, b, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "4 records, seed 0" in out and "4 records, seed 1" in out
    md = (tmp_path / "out" / "results.md").read_text()
    assert "seeds 0, 1" in md and "| query_agnostic | 2048 | 2d_hetero @ 14x | 4 | 75.0 | 75.0 | +0.0" in md
    assert (tmp_path / "out" / "accuracy_vs_bytes.png").stat().st_size > 0


def test_report_on_a_path_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "neither results.json nor records.jsonl" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_report_with_another_reference(tmp_path, capsys):
    a = _run(tmp_path / "a", 0, [(1.0, 1.0), (1.0, 0.0)])
    assert main(["report", a, "--reference", "2d_hetero", "--out", str(tmp_path / "out")]) == 0
    assert "Paired with `2d_hetero`" not in (tmp_path / "out" / "results.md").read_text()  # nothing else budgeted
    assert main(["report", a, "--reference", "pyramid", "--out", str(tmp_path / "o2")]) == 2
    assert "--reference pyramid: no pooled record is of that method; they are of 2d_hetero, full" in \
        capsys.readouterr().err


def test_report_pools_only_the_lengths_asked(tmp_path, capsys):
    a = _run(tmp_path / "a", 0, [(1.0, 1.0), (1.0, 0.0)])
    assert main(["report", a, "--lengths", "2048", "--out", str(tmp_path / "out")]) == 0
    assert "| query_agnostic | 2048 | 2d_hetero @ 14x | 2 |" in (tmp_path / "out" / "results.md").read_text()
    capsys.readouterr()
    assert main(["report", a, "--lengths", "4096", "--out", str(tmp_path / "o2")]) == 2
    assert "no run holds length(s) 4096; these runs hold 2048" in capsys.readouterr().err
    assert main(["report", a, "--lengths", "2k", "--out", str(tmp_path / "o3")]) == 2
    assert "--lengths" in capsys.readouterr().err and not (tmp_path / "o3").exists()
