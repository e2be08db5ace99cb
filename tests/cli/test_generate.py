"""``moend generate`` on a tiny model saved as a local Hugging Face folder, and its user-error paths."""

from __future__ import annotations

import re

import pytest
import torch

from moend_fx.calibration.pipeline import calibrate
from moend_fx.calibration.tables import default_table_path
from moend_fx.cli import main
from moend_fx.models import tiny_preset
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from tests.models.helpers import save_tiny_folder

TINY = "llama-gqa3-hd64"  # SmolLM2's head layout in miniature
PROMPT = " ".join(f"w{(7 * i) % 250 + 1}" for i in range(80))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder(path, TINY)
    return path


@pytest.fixture(scope="module")
def table_file(folder, tmp_path_factory):
    model = tiny_preset(TINY)
    ids = torch.randint(1, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("table") / "tiny.safetensors"
    calibrate(model, token_ids=ids).save(path)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _check_report(out: str) -> None:
    assert "---" in out
    m = re.search(r"cache: .* measured for (\d+) tokens; full cache .* at 16 bits \(([\d.]+)x smaller\), "
                  r".* in float32 \(([\d.]+)x\)", out)
    assert m, out
    assert int(m.group(1)) == 80 + 8 - 1  # prompt + new tokens; the last one is never fed back
    # fp32 full cache is twice the 16-bit one, so its ratio is twice the 16-bit ratio (to print rounding)
    assert float(m.group(3)) == pytest.approx(2 * float(m.group(2)), abs=0.11)
    assert re.search(r"time: 8 new tokens after a 80-token prompt in [\d.]+ s", out)


def test_generate_with_budget_and_table(folder, table_file, capsys):
    code, out, err = _run(capsys, "--model", str(folder), "--budget", "3x", "--table", str(table_file),
                          "--prompt", PROMPT, "--max-new-tokens", "8")
    assert code == 0, err
    _check_report(out)
    assert f"greedy for budget 3x on {table_file}" in out


def test_generate_with_plan_file(folder, tmp_path, capsys):
    fp = ModelFingerprint.from_model(tiny_preset(TINY))
    # priced for the cache `moend generate --plan` builds without --table (no calibrated query statistics)
    plan_path = RoutingPlan.uniform(LayerConfig(0.5, 4, 8), fp, 88, calibrated=False).save(tmp_path / "plan.json")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    code, out, err = _run(capsys, "--model", str(folder), "--plan", str(plan_path), "--file", str(prompt_file),
                          "--max-new-tokens", "8")
    assert code == 0, err
    _check_report(out)
    assert "3x keep 0.5/K4/V8" in out


def test_generate_calibrates_when_no_table(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOEND_CACHE", str(tmp_path / "cache"))
    code, out, err = _run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--calib-tokens", "96", "--quiet", "--budget", "3x")
    assert code == 0, err
    assert "no query_aware sensitivity table" in err and "calibrating on 96 tokens" in err
    saved = default_table_path(str(folder), 96, scorer="snapkv_trig")  # the default setting's scorer
    assert saved.parent == tmp_path / "cache" / "tables"
    assert saved.is_file() and "just calibrated" in out
    # second time the saved table is reused, no calibration
    code, out, err = _run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--calib-tokens", "96", "--quiet", "--budget", "3x")
    assert code == 0 and "calibrating" not in err and str(saved) in out
    # a table calibrated with other scorer options (an older version) is skipped and calibrated again
    import dataclasses

    from moend_fx.calibration.sensitivity import SensitivityTable

    old = SensitivityTable.load(saved)
    dataclasses.replace(old, calibration={**old.calibration, "scorer_options": {"pooling": "none"}}).save(saved)
    code, out, err = _run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--calib-tokens", "96", "--quiet", "--budget", "3x")
    assert code == 0 and "skipping" in err and "scorer options" in err and "calibrating on 96 tokens" in err
    assert "just calibrated" in out
    # the query-agnostic setting has its own table, calibrated with trig
    code, out, err = _run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--calib-tokens", "96", "--quiet", "--budget", "3x", "--setting", "query_agnostic")
    assert code == 0 and "no query_agnostic sensitivity table" in err
    agnostic = default_table_path(str(folder), 96, scorer="trig")
    assert agnostic.is_file() and SensitivityTable.load(agnostic).calibration["scorer"] == "trig"


def _one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.strip().replace("\r", "\n").splitlines()
    assert lines[-1].startswith("moend: error:"), err
    assert "Traceback" not in err
    # the only other output allowed: transformers' weight-loading progress bar
    assert all(line.startswith("Loading weights") for line in lines[:-1] if line.strip()), err
    for w in words:
        assert w in lines[-1], lines[-1]


def test_error_missing_prompt_file(folder, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--file", "/nonexistent/p.txt"), "/nonexistent/p.txt")


def test_error_missing_plan_file(folder, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--plan", "/nonexistent/plan.json", "--prompt", "w1"),
                    "plan file", "/nonexistent/plan.json")


def test_error_bad_budget(folder, table_file, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--budget", "fourteen", "--table", str(table_file),
                          "--prompt", PROMPT), "fourteen")


def test_error_plan_for_another_model(folder, tmp_path, capsys):
    other = ModelFingerprint.from_model(tiny_preset("llama-gqa-hd16"))
    plan_path = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), other, 64).save(tmp_path / "other.json")
    _one_line_error(*_run(capsys, "--model", str(folder), "--plan", str(plan_path), "--prompt", PROMPT), "plan")


def test_error_table_for_another_model(folder, tmp_path, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--table", "synthetic:30", "--prompt", PROMPT),
                    "another model")


def test_error_unknown_model(capsys):
    _one_line_error(*_run(capsys, "--model", "gpt-99", "--prompt", "hi"), "gpt-99", "smollm2")


def test_error_empty_prompt_and_bad_tokens(folder, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--prompt", "  "), "empty")
    _one_line_error(*_run(capsys, "--model", str(folder), "--prompt", "w1", "--max-new-tokens", "0"),
                    "--max-new-tokens=0")


def test_prompt_is_required(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own usage error: exit 2, one line
        main(["generate"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--prompt --file is required" in err


@pytest.mark.slow
def test_generate_smollm2(capsys):
    """The real model with the cached table (calibrated on first use: a minute or two)."""
    prompt = "Remember this: the secret code is 4711. " * 40 + "What is the secret code? The secret code is"
    code, out, err = _run(capsys, "--budget", "8x", "--prompt", prompt, "--max-new-tokens", "6", "--quiet")
    assert code == 0, err
    assert "4711" in out.split("---")[0]  # retrieval survives an 8x cache on this easy prompt
    assert re.search(r"at 16 bits \(([\d.]+)x smaller\)", out)


def test_generate_with_a_chunked_prefill(folder, table_file, capsys):
    """--prefill-chunk reaches prepare: the 80-token prompt goes in as chunks of 32 (above 40 tokens)."""
    code, out, err = _run(capsys, "--model", str(folder), "--budget", "3x", "--table", str(table_file),
                          "--prompt", PROMPT, "--max-new-tokens", "8", "--prefill-chunk", "32",
                          "--prefill-chunk-above", "40")
    assert code == 0, err
    _check_report(out)
    assert "prefill in chunks of 32" in out


def test_short_prompts_are_prefilled_in_one_pass(folder, table_file, capsys):
    code, out, err = _run(capsys, "--model", str(folder), "--budget", "3x", "--table", str(table_file),
                          "--prompt", PROMPT, "--max-new-tokens", "8")
    assert code == 0, err
    assert "prefill in one pass" in out  # 80 tokens, below the default 4096


def test_error_bad_prefill_chunk(folder, capsys):
    _one_line_error(*_run(capsys, "--model", str(folder), "--prompt", PROMPT, "--prefill-chunk", "1"),
                    "prefill_chunk=1", "int >= 2")
