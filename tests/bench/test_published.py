"""Every table and figure in README.md and docs/results.md re-renders from the committed records in docs/data/,
and docs/data holds only the records a published table or figure reads (moend_fx.bench.published_*)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from moend_fx.bench.published_figures import FIGURES
from moend_fx.bench.published_render import DOCS, fill_tables, record_folders, table_blocks
from moend_fx.bench.published_tables import render_table, table_names
from moend_fx.common.errors import MoendError

ROOT = Path(__file__).parents[2]
DATA = ROOT / "docs" / "data"
# Hand-written tables allowed outside the markers: an index of sections, and the README's standing table (whose
# numbers are checked against the rendered tables below).
UNMARKED_HEADERS = {"| section | records |", "| what | today |", "| use | start here |", "| stage | folder | docs |"}


def _text(doc: str) -> str:
    return (ROOT / doc).read_text()


@pytest.mark.parametrize("doc", DOCS)
def test_marked_tables_are_what_their_records_render_to(doc):
    text = _text(doc)
    assert fill_tables(text, DATA) == text, (
        f"{doc}: a marked table differs from what its records in docs/data render to: run `make figures`")


def test_every_published_table_is_in_a_document_and_every_marker_is_known():
    marked = set().union(*(table_blocks(_text(d)) for d in DOCS))
    assert marked == set(table_names())


def _tables_outside_markers(text: str) -> list[str]:
    outside = re.sub(r"<!-- table:([a-z0-9-]+) -->\n.*?<!-- /table:\1 -->", "", text, flags=re.S)
    lines = outside.splitlines()
    return [lines[i] for i in range(len(lines) - 1)
            if lines[i].startswith("|") and re.match(r"^\|\s*:?-{3}", lines[i + 1])]


@pytest.mark.parametrize("doc", DOCS)
def test_no_table_of_measurements_outside_the_markers(doc):
    headers = _tables_outside_markers(_text(doc))
    assert set(headers) <= UNMARKED_HEADERS, f"{doc}: tables not rendered from records: {headers}"


def test_docs_data_holds_only_what_a_published_table_or_figure_reads():
    present = {p.name for p in DATA.iterdir() if p.is_dir()}
    assert present == record_folders(), (
        f"not read by any published table or figure: {sorted(present - record_folders())}; "
        f"missing: {sorted(record_folders() - present)}")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_every_linked_figure_re_renders_from_the_records(tmp_path):
    linked = set()
    for doc in DOCS:
        linked |= {Path(m).name for m in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", _text(doc))}
    assert linked == set(FIGURES), f"figures linked {sorted(linked)}, rendered {sorted(FIGURES)}"
    for name, (draw, _) in FIGURES.items():
        out = draw(DATA, tmp_path / name)
        committed = ROOT / "docs" / "img" / name
        # Same size as the committed image: the pixels may differ by font rendering across machines.
        assert _png_size(out) == _png_size(committed), f"{name}: re-rendered at another size: run `make figures`"


def _section_tables(anchor: str) -> str:
    """The rendered tables of docs/results.md's section whose heading slugs to ``anchor``."""
    text = _text("docs/results.md")
    parts = re.split(r"^## ", text, flags=re.M)
    for part in parts[1:]:
        title = part.splitlines()[0]
        slug = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        if slug == anchor:
            return "\n".join(table_blocks(part).values())
    raise AssertionError(f"docs/results.md has no section #{anchor}")


def _standing_rows() -> list[tuple[str, str]]:
    readme = _text("README.md")
    table = readme.split("## Where it stands", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[[^\]]+\]\(docs/results\.md#([a-z0-9-]+)\) \| (.+) \|$", table, re.M)
    return rows


def test_readme_standing_table_is_short_and_links_to_results():
    rows = _standing_rows()
    assert 5 <= len(rows) <= 10
    for anchor, _ in rows:
        _section_tables(anchor)


@pytest.mark.parametrize("anchor,cell", _standing_rows())
def test_readme_standing_numbers_are_in_the_rendered_tables(anchor, cell):
    """Every decimal number of a standing row (a difference, a ratio, a rate) appears in the tables of the
    section it links to, which are rendered from records: the front page cannot drift from them."""
    tables = _section_tables(anchor)
    # A sign belongs to a number only after a space ("-1.7"), not inside a range ("14.4x-14.6x"); names such as
    # "Qwen2.5" are not numbers.
    for num in re.findall(r"(?:(?<=[\s(])[+-])?(?<![\w.])\d+\.\d+(?![\dA-Za-wyz])", cell):
        assert re.search(rf"(?<![\d.]){re.escape(num)}(?![\d])", tables), (
            f"README row #{anchor}: {num} is not in that section's rendered tables")


def test_unknown_table_is_a_clear_error():
    with pytest.raises(MoendError, match="allowed: accuracy-2k4k"):
        render_table("accuracy-3k", DATA)
