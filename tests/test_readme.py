"""The README is executable documentation: its set-up commands, its CLI commands and its Python example run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moend_fx.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(text: str, lang: str | None = None) -> list[str]:
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S) if lang is None or m.group(1) == lang]


def test_quickstart_is_the_two_make_commands():
    bash = "\n".join(fenced_blocks(README, "bash"))
    assert re.search(r"^make demo\b", bash, re.M) and re.search(r"^make test\b", bash, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) < 200  # a front page, not the results notebook (docs/results.md holds those)
    images = re.findall(r"!\[[^\]]*\]\((docs/img/[^)]+\.png)\)", README)
    assert len(images) == 2 and all((ROOT / p).is_file() for p in images)
    for use in ('backend="moend"', "docs/kernel-testing.md", "docs/solver-study.md"):
        assert use in README


def _moend_commands():
    out = []
    for doc in DOCS:
        for block in fenced_blocks(doc.read_text()):
            for line in block.splitlines():
                line = line.strip()
                if line.startswith("moend "):
                    out.append((doc.name, line))
    return out


@pytest.mark.parametrize("doc,line", _moend_commands())
def test_documented_cli_commands_exist(doc, line):
    words = line.split()[1:]
    top = build_parser().subcommands()
    assert words[0] in top, f"{doc}: `{line}` names an unknown subcommand {words[0]!r}"
    inner = top[words[0]].subcommands()
    if inner and len(words) > 1 and not words[1].startswith("-"):
        assert words[1] in inner, f"{doc}: `{line}` names an unknown subcommand {words[1]!r}"


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path):
    (code,) = fenced_blocks(README, "python")
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if "| expected:" in l]
    assert lines, f"no answer line in stdout={r.stdout[-2000:]!r} stderr={r.stderr[-2000:]!r}"
    answer, expected = lines[-1].split("| expected:")
    assert expected.strip() in answer  # the compressed, compiled model still finds the pass key
