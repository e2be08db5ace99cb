"""``moend bench``: decode on a tiny model folder, solvers on a synthetic table, ``all`` regenerating the
results document, and user errors. Structure only, never timings."""

from __future__ import annotations

import json

import pytest
import torch

from moend_fx.bench.report import KEYS, existing_blocks
from moend_fx.cli import main
from tests.models.helpers import save_tiny_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bench")
    save_tiny_folder(path, "llama-gqa3-hd64")
    return path


def test_bench_decode_cli(folder, tmp_path, capsys):
    out, doc = tmp_path / "res", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    code = main(["bench", "decode", "--model", str(folder), "--lengths", "48,64", "--steps", "2", "--warmup", "1",
                 "--methods", "full_eager,moend_eager", "--threads", "1", "--out", str(out), "--doc", str(doc),
                 "--no-progress", "--evict-every", "1", "--reevict", "tokens"])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads((out / "decode" / "decode.json").read_text())
    assert [(r["method"], r["tokens"]) for r in result["rows"]] == [
        ("full_eager", 48), ("full_eager", 64), ("moend_eager", 48), ("moend_eager", 64)]
    assert result["meta"]["threads"] == 1
    assert (result["meta"]["settings"]["evict_every"], result["meta"]["settings"]["reevict"]) == (1, "tokens")
    assert "| moend_eager | 64 |" in printed
    block = existing_blocks(doc.read_text())["decode"]
    # the section is headed by the command that regenerates it (non-default options + --out)
    assert f"moend bench decode --model {folder} --lengths 48,64 --steps 2 --warmup 1" in block
    assert f"--out {out}" in block and "decode.png" in block
    assert (out / "sections" / "decode.md").is_file()


def test_bench_solvers_and_all_keep_sections(tmp_path, capsys):
    out, doc = tmp_path / "res", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    assert main(["bench", "solvers", "--table", "synthetic:6", "--repeats", "2", "--out", str(out),
                 "--doc", str(doc)]) == 0
    assert (out / "solvers" / "compare.json").is_file() and (out / "solvers" / "compare.png").is_file()
    first = existing_blocks(doc.read_text())
    assert "moend bench solvers --table synthetic:6 --repeats 2" in first["solvers"]
    assert "greedy median" in first["solvers"]
    # `all --only solvers --quick` re-runs the solvers only; the other sections stay placeholders
    code = main(["bench", "all", "--only", "solvers", "--quick", "--out", str(out), "--doc", str(doc)])
    assert code == 0
    blocks = existing_blocks(doc.read_text())
    assert list(blocks) == list(KEYS)
    assert "moend bench solvers" in blocks["solvers"] and "--repeats 5" in blocks["solvers"]  # --quick's
    assert "Not run yet" in blocks["decode"]
    capsys.readouterr()


def test_bench_all_reports_failures_and_continues(tmp_path, capsys, monkeypatch):
    import moend_fx.bench.suite as suite
    from moend_fx.common.errors import MoendError

    def boom(*a, **k):
        raise MoendError("kernel benchmark unavailable here")

    monkeypatch.setattr(suite, "bench_kernels_section", boom)
    code, printed, blocks = quick_all(tmp_path, capsys, "kernels,solvers")
    assert code == 2
    assert "moend bench kernels: error: kernel benchmark unavailable here" in printed.err
    assert "benchmark(s) failed: kernels" in printed.err
    assert "greedy median" in blocks["solvers"] and "Not run yet" in blocks["kernels"]


def quick_all(tmp_path, capsys, only):
    """``moend bench all --quick --only ONLY`` into tmp_path: (exit code, captured output, the document's blocks)."""
    out, doc = tmp_path / "res", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    code = main(["bench", "all", "--only", only, "--quick", "--out", str(out), "--doc", str(doc)])
    return code, capsys.readouterr(), existing_blocks(doc.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_bench_all_skips_the_gpu_benchmark_without_cuda(tmp_path, capsys):
    code, printed, blocks = quick_all(tmp_path, capsys, "triton,solvers")
    assert code == 0
    assert "moend bench triton: skipped (needs a CUDA GPU" in printed.out
    assert "greedy median" in blocks["solvers"] and "Not run yet" in blocks["triton"]


@pytest.mark.parametrize("argv, words", [
    (["bench", "decode", "--lengths", "2k", "--doc", ""], ["--lengths='2k'"]),
    (["bench", "decode", "--methods", "fast", "--doc", ""], ["'fast'", "full_eager"]),
    (["bench", "decode", "--uniform", "0.25,4", "--doc", ""], ["--uniform='0.25,4'"]),
    (["bench", "decode", "--plan", "/nonexistent.json", "--doc", ""], ["/nonexistent.json"]),
    (["bench", "solvers", "--table", "nope.safetensors", "--doc", ""], ["nope.safetensors"]),
    (["bench", "all", "--only", "speed", "--doc", ""], ["'speed'", "decode"]),
    pytest.param(["bench", "triton", "--doc", ""], ["CUDA GPU", "moend bench kernels"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")),
])
def test_user_errors_are_one_line(argv, words, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    last = err.replace("\r", "\n").splitlines()[-1]
    assert last.startswith("moend: error:") and "Traceback" not in err
    for w in words:
        assert w in last, last


def test_bench_eval_runs_every_part_into_one_report_and_resumes(folder, tmp_path, capsys, monkeypatch):
    """The published evaluation is parts of different tasks, lengths and n: one records file, one report whose
    header says what each length holds, and a second call runs nothing."""
    from moend_fx.bench.published import PUBLISHED_EVAL
    from moend_fx.calibration.pipeline import calibrate
    from moend_fx.eval.parts import EvalPart
    from moend_fx.eval.runner import Runner
    from moend_fx.models import load_model

    model, _ = load_model(str(folder))
    table_path = tmp_path / "table.safetensors"
    calibrate(model, tokens=64, num_sequences=1).save(table_path)
    monkeypatch.setitem(PUBLISHED_EVAL, "parts", (EvalPart(("passkey", "niah_single"), (160,), 2),
                                                  EvalPart(("niah_single",), (224,), 1)))
    out, doc = tmp_path / "res", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    argv = ["bench", "eval", "--model", str(folder), "--table", str(table_path), "--methods", "full,2d_hetero",
            "--budgets", "8x", "--settings", "query_agnostic", "--max-new-tokens", "2", "--threads", "1",
            "--out", str(out), "--doc", str(doc), "--no-progress"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "eval" / "records.jsonl").read_text().splitlines()]
    cells = {(r["task"], r["target_length"], r["index"]) for r in records}
    assert cells == {("passkey", 160, 0), ("passkey", 160, 1), ("niah_single", 160, 0), ("niah_single", 160, 1),
                     ("niah_single", 224, 0)}
    meta = json.loads((out / "eval" / "results.json").read_text())["meta"]
    assert [(p["lengths"], p["n"]) for p in meta["parts"]] == [([160], 2), ([224], 1)]
    block = existing_blocks(doc.read_text())["eval"]
    assert "160 tokens: niah_single, passkey (n = 2 per task); 224 tokens: niah_single (n = 1 per task)" in block
    plans = meta_plans(out)
    assert any(k.startswith("2d_hetero|8x|") for k in plans)
    monkeypatch.setattr(Runner, "run_example", lambda *a, **k: pytest.fail("a done example was run again"))
    assert main(argv) == 0
    assert meta_plans(out) == plans  # the resumed report keeps the plans it did not solve again
    capsys.readouterr()


def meta_plans(out):
    return json.loads((out / "eval" / "results.json").read_text())["plans"]


def test_bench_eval_names_a_damaged_report_it_would_resume_from(folder, tmp_path, capsys):
    bad = tmp_path / "res" / "eval" / "results.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert main(["bench", "eval", "--model", str(folder), "--out", str(tmp_path / "res"), "--doc", "",
                 "--lengths", "160", "--n", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "results.json is not an evaluation report" in err and "Traceback" not in err
    assert bad.read_text() == "{not json"  # left as it was
