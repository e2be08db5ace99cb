"""Re-render every published table and figure from the committed records (``moend report --published``,
``make figures``).

A document marks each published table as ``<!-- table:NAME -->`` ... ``<!-- /table:NAME -->``;
:func:`fill_tables` replaces the text between the markers with what :mod:`moend_fx.bench.published_tables` renders
from ``docs/data/NAME/`` and leaves every other line as it is. :func:`render_published` does that for README.md and
docs/results.md and redraws the figures of :mod:`moend_fx.bench.published_figures` into docs/img/.
"""

from __future__ import annotations

import re
from pathlib import Path

from moend_fx.bench.published_figures import FIGURES
from moend_fx.bench.published_tables import TABLES, VIEWS, render_table
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text

DOCS = ("README.md", "docs/results.md")
_BLOCK = re.compile(r"(<!-- table:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def table_blocks(text: str) -> dict[str, str]:
    """``{name: body}`` of the marked tables in a document's text."""
    return {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}


def fill_tables(text: str, data_dir: Path) -> str:
    """``text`` with every marked table re-rendered from ``data_dir``."""
    return _BLOCK.sub(lambda m: m.group(1) + render_table(m.group("name"), data_dir) + m.group(4), text)


def record_folders() -> set[str]:
    """The folders under docs/data that a published table or figure reads."""
    out = {t.name for t in TABLES} | {folder for folder, _ in VIEWS.values()}
    for _, folders in FIGURES.values():
        out |= set(folders)
    return out


def render_published(root: str | Path) -> list[Path]:
    """Rewrite the marked tables of README.md and docs/results.md and the figures in docs/img/ from the records
    in docs/data/ under the repository ``root``. Returns the files written."""
    root = Path(root)
    data = root / "docs" / "data"
    if not data.is_dir():
        raise MoendError(f"{data} is not a folder: run from the repository root (it holds docs/data/)")
    written = []
    for name, (draw, _) in FIGURES.items():
        written.append(draw(data, root / "docs" / "img" / name))
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        new = fill_tables(text, data)
        if new != text:
            written.append(atomic_write_text(path, new))
    return written
