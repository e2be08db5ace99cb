"""Teacher-forced continuation KL on a tiny random model (tests/eval/conftest.py): what it measures, and resuming
a stopped run."""

from __future__ import annotations

import json

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.eval import continuation as cont_mod
from moend_fx.eval.continuation import continuation_eval, sequence_digest
from moend_fx.eval.report import (
    markdown_continuation,
    markdown_continuation_paired,
    paired_continuation,
    summarize_continuation,
    write_report,
)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(5))


def test_continuation_kl_full_zero_lossless_tiny_compressed_positive(model, table, ids):
    recs = continuation_eval(model, table, ids, 160, methods=("full", "lossless", "2d_hetero"), budgets=("4x",),
                             progress=False)
    by = {(r["sequence"], r["method"]): r for r in recs}
    assert len(recs) == 6
    for i in range(2):
        assert by[(i, "full")]["kl"] == 0.0 and by[(i, "full")]["loss"] == by[(i, "full")]["loss_full"]
        # Reference attention over the packed lossless layer vs SDPA: same maths, fp32 reduction order.
        assert by[(i, "lossless")]["kl"] < 1e-6
        assert by[(i, "2d_hetero")]["kl"] > 1e-6
        assert by[(i, "2d_hetero")]["ratio16"] >= 4.0
    rows = summarize_continuation(recs)
    assert [r["method"] for r in rows] == ["full", "lossless", "2d_hetero"] and all(r["n"] == 2 for r in rows)
    assert "KL from full" in markdown_continuation(rows)
    with pytest.raises(MoendError, match="context_length"):
        continuation_eval(model, table, ids, 199, methods=("full",), budgets=("4x",), progress=False)


def _count_sequences(monkeypatch) -> list[int]:
    ran: list[int] = []
    real = cont_mod._ContinuationRun.sequence

    def counting(self, i, row, context_length):
        ran.append(i)
        return real(self, i, row, context_length)

    monkeypatch.setattr(cont_mod._ContinuationRun, "sequence", counting)
    return ran


def test_resume_runs_only_missing_sequences_and_keeps_other_lengths(model, table, ids, tmp_path, monkeypatch):
    path = tmp_path / "continuation.jsonl"
    kw = dict(methods=("full", "2d_hetero"), budgets=("4x",), progress=False, records=path)
    first = continuation_eval(model, table, ids[:1], 160, **kw)
    assert len(path.read_text().splitlines()) == len(first) == 2  # written after the sequence
    other = continuation_eval(model, table, ids, 120, **kw)  # another length, same file
    ran = _count_sequences(monkeypatch)
    both = continuation_eval(model, table, ids, 160, **kw)
    assert ran == [1]  # sequence 0 at 160 was on file
    assert both[:2] == first  # reused as recorded
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(other) + len(both) == 8
    assert {r["context_length"] for r in lines} == {120, 160}
    # Another budget is missing from the records: the sequence runs again; so does different text.
    ran.clear()
    continuation_eval(model, table, ids, 160, **dict(kw, budgets=("4x", "8x")))
    assert ran == [0, 1]
    ran.clear()
    continuation_eval(model, table, ids.flip(1), 160, **kw)
    assert ran == [0, 1]
    ran.clear()
    continuation_eval(model, table, ids, 160, **dict(kw, resume=False))
    assert ran == [0, 1]


def test_digest_depends_on_the_tokens(ids):
    assert sequence_digest(ids[0]) == sequence_digest(ids[0].clone())
    assert sequence_digest(ids[0]) != sequence_digest(ids[1])


def test_bad_records_file_named_and_left_alone(model, table, ids, tmp_path):
    path = tmp_path / "continuation.jsonl"
    path.write_text('{"sequence": 0}\n')
    with pytest.raises(MoendError, match=r"continuation\.jsonl:1 lacks"):
        continuation_eval(model, table, ids, 160, methods=("full",), budgets=("4x",), progress=False, records=path)
    assert path.read_text() == '{"sequence": 0}\n'


def test_continuation_only_report(model, table, ids, tmp_path):
    recs = continuation_eval(model, table, ids[:1], 160, methods=("full", "2d_hetero"), budgets=("4x",),
                             progress=False)
    written = write_report([], tmp_path, meta={}, continuation=recs)
    assert set(written) == {"json", "md"}  # no accuracy plot without task records
    doc = json.loads(written["json"].read_text())
    assert doc["records"] == [] and len(doc["continuation"]["records"]) == 2
    assert doc["continuation"]["paired"] == []  # one sequence: nothing to pair
    assert written["md"].read_text().startswith("### Teacher-forced continuation")
    with pytest.raises(MoendError, match="no records"):
        write_report([], tmp_path, meta={})


def _rec(seq, method, budget, kl, length=100):
    return dict(sequence=seq, context_length=length, context_tokens=length, method=method, budget=budget, kl=kl)


def test_paired_continuation_against_the_reference():
    recs = [_rec(0, "2d_hetero", "8x", 0.1), _rec(1, "2d_hetero", "8x", 0.2), _rec(2, "2d_hetero", "8x", 0.3),
            _rec(0, "pyramid", "8x", 0.3), _rec(1, "pyramid", "8x", 0.3), _rec(2, "pyramid", "8x", 0.2),
            _rec(0, "full", None, 0.0), _rec(1, "full", None, 0.0), _rec(0, "pyramid", "14x", 0.5)]
    rows = paired_continuation(recs)
    assert len(rows) == 1  # full has no budget; pyramid at 14x has no 2d_hetero to pair with
    (r,) = rows
    assert (r["method"], r["budget"], r["n"], r["ref_lower"]) == ("pyramid", "8x", 3, 2)
    assert r["diff"] == pytest.approx((0.2 + 0.1 - 0.1) / 3)
    sd = float(torch.tensor([0.2, 0.1, -0.1], dtype=torch.float64).std())
    assert r["diff_ci"] == pytest.approx(2 * sd / 3 ** 0.5)
    assert r["rel"] == pytest.approx(r["diff"] / (0.8 / 3))
    md = markdown_continuation_paired(rows)
    assert "| 100 | 8x | pyramid | 3 |" in md and "2/3" in md
    assert markdown_continuation_paired([]) == ""
