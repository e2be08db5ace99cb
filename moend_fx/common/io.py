"""Atomic file writes: a reader never sees a half-written plan, table or result file."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600 files; give the result the permissions a plain open() would (umask applies).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave nothing behind: the old file (if any) stays intact.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_existing(path: str | os.PathLike, what: str, error: type[Exception], hint: str = "") -> bytes:
    """The bytes of file ``path``, or ``error`` naming ``what`` it should be (e.g. "plan file") and ``hint``."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist" + (f"; {hint}" if hint else ""))
    return p.read_bytes()


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Render a matplotlib figure to PNG, write it atomically, and close the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
