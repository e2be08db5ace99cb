"""Atomic writes and checked reads (moend_fx.common.io)."""

import pytest

import moend_fx.common.io as io_mod
from moend_fx.common.errors import PlanError, TableError


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    path = io_mod.atomic_write_text(tmp_path / "sub" / "out.txt", "one")
    io_mod.atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_failed_text_write_creates_no_file(tmp_path, monkeypatch):
    """With no previous file, a failed ``atomic_write_text`` leaves nothing at all in the folder."""

    def no_rename(*args):
        raise OSError("no rename")

    monkeypatch.setattr(io_mod.os, "replace", no_rename)
    with pytest.raises(OSError, match="no rename"):
        io_mod.atomic_write_text(tmp_path / "out.txt", "hello")
    assert list(tmp_path.iterdir()) == []


def test_read_existing_returns_bytes_or_names_the_missing_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00\x01")
    assert io_mod.read_existing(tmp_path / "a.bin", "plan file", PlanError) == b"\x00\x01"
    with pytest.raises(TableError, match=r"sensitivity table '.*b.bin' does not exist; run this"):
        io_mod.read_existing(tmp_path / "b.bin", "sensitivity table", TableError, "run this")
    with pytest.raises(PlanError, match="does not exist$"):
        io_mod.read_existing(tmp_path, "plan file", PlanError)  # a folder is no file
