"""docs/results.md keeps its hand-written readings where a re-run finds them: each section's notes file
(``docs/results-notes/<key>.md``) is what the section ends with, so ``moend bench <key>`` rewrites the tables
without losing a reading that was added to the document alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moend_fx.bench.report import existing_blocks, notes_path

DOC = Path(__file__).parents[2] / "docs" / "results.md"
KEYS = sorted(existing_blocks(DOC.read_text()))  # the document is read again by each test (it may be edited meanwhile)


@pytest.mark.parametrize("key", [k for k in KEYS if notes_path(DOC, k).is_file()])
def test_a_sections_reading_is_its_notes_file(key):
    notes = notes_path(DOC, key).read_text().rstrip()
    assert notes, f"{notes_path(DOC, key)} is empty"
    assert existing_blocks(DOC.read_text())[key].rstrip().endswith(notes), (
        f"section {key} of {DOC.name} does not end with {notes_path(DOC, key).name}: edit the notes file (the "
        "source a re-run appends) and the document together")


def test_the_document_has_the_sections_with_notes():
    assert {"decode", "eval", "prefill", "kernels", "triton", "proxy"} <= set(KEYS)
    for key in KEYS:
        assert notes_path(DOC, key).is_file(), f"section {key} has no reading in results-notes/{key}.md"


def test_results_holds_current_figures_only_and_history_one_line_per_finding():
    assert len(DOC.read_text().splitlines()) <= 600  # the bound: current figures, not a lab notebook
    history = (DOC.parent / "history.md").read_text()
    rows = [line for line in history.splitlines() if line.startswith("| 2026")]
    assert len(rows) >= 20
    for row in rows:  # date | what | figure | decision | commit, each on one line
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and all(cells), f"history.md row is not date | what | figure | decision | commit: {row}"
        assert re.search(r"\b[0-9a-f]{7}\b|git history", cells[4]), f"history.md row names no commit: {row}"
