"""The `moend` entry point as a user meets it: help everywhere, one-line errors with exit code 2."""

import shutil
import subprocess
import sys

import pytest

from moend_fx.cli import build_parser, main


def _all_commands():
    out = []
    for name, sub in build_parser().subcommands().items():
        out.append([name])
        out += [[name, inner] for inner in sub.subcommands()]
    return out


COMMANDS = _all_commands()


def test_every_issue_subcommand_exists():
    names = {c[0] for c in COMMANDS}
    assert {"calibrate", "show-table", "solve", "compare-solvers", "eval", "generate", "bench",
            "validate-proxy"} <= names
    assert {"decode", "solvers", "calibrate", "kernels", "eval", "proxy", "all"} <= {c[1] for c in COMMANDS
                                                                                   if len(c) == 2}


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert f"usage: moend {' '.join(argv)}" in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: moend" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["solve", "--table", "synthetic:4", "--budget", "14y"], "does not parse"),
    (["solve", "--table", "/no/such/table.safetensors", "--budget", "14x"], "does not exist"),
    (["solve", "--table", "synthetic:4", "--budget", "14x", "--solver", "magic"], "invalid choice: 'magic'"),
    (["show-table", "/no/such/table.safetensors"], "does not exist"),
])
def test_installed_entry_point_errors_are_one_line(argv, words):
    exe = shutil.which("moend") or str(__import__("pathlib").Path(sys.executable).parent / "moend")
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("moend: error:") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_eval_refuses_a_stale_default_table(tmp_path, monkeypatch, capsys):
    """A cached table calibrated with other scorer options than this version's is not silently used."""
    import dataclasses

    from moend_fx.calibration.pipeline import calibrate
    from moend_fx.calibration.tables import default_table_path
    from moend_fx.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    table = calibrate(model, tokens=64, num_sequences=1)
    table = dataclasses.replace(table, calibration={**table.calibration, "scorer_options": {"pooling": "none"}})
    monkeypatch.setenv("MOEND_CACHE", str(tmp_path / "cache"))
    table.save(default_table_path(str(folder)))  # where `moend eval` looks by default
    assert main(["eval", "--model", str(folder), "--n", "1", "--settings", "query_agnostic",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "scorer options" in err and "moend calibrate" in err and "Traceback" not in err
    # the query-aware setting reads its own table (scorer snapkv_trig), which is not there: named, with the fix
    assert main(["eval", "--model", str(folder), "--n", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "snapkv_trig-2048" in err and "moend calibrate --setting query_aware" in err


def test_eval_continuation_only_needs_sequences(tmp_path, capsys):
    assert main(["eval", "--continuation-only", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--continuation-only needs --continuation N" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["bench", "decode", "--batches", "1,0", "--doc", ""],  # sets every core, errs
                                  ["bench", "decode", "--threads", "2", "--batches", "1,1", "--doc", ""]])
def test_a_command_gives_the_caller_its_torch_threads_back(argv, capsys):
    """A command sets torch's intra-op threads for itself (the benchmarks default to every core); run in-process
    it must not leave them set: the test process runs at one thread, a leaked count oversubscribes the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 2  # the user error comes after the threads were set
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "moend: error:" in capsys.readouterr().err
