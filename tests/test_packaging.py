"""The built wheel installs `passes/` as `moend_fx.passes` (no top-level `passes`), every subpackage, the C++
kernel source and both entry points."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: build with the venv's setuptools, no download.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("moend_fx-*.whl")
    return zipfile.ZipFile(whl)


def test_passes_ship_inside_moend_fx(wheel):
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"moend_fx", next(t for t in tops if t.endswith(".dist-info"))}
    for f in (ROOT / "passes").glob("*.py"):
        assert f"moend_fx/passes/{f.name}" in names


def test_every_subpackage_and_data_file_ships(wheel):
    names = set(wheel.namelist())
    for init in (ROOT / "moend_fx").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names
    assert "moend_fx/kernels/moend_attn.cpp" in names


def test_entry_points(wheel):
    ep = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    text = wheel.read(ep).decode()
    assert "moend = moend_fx.cli:main" in text
    assert "[torch_dynamo_backends]" in text and "moend = moend_fx.compile.backend:moend_backend" in text


def test_editable_install_imports_passes_under_moend_fx():
    import moend_fx.passes

    assert Path(moend_fx.passes.__file__).resolve().parent == ROOT / "passes"
