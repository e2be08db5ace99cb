"""Build, cache and call the fused C++ CPU attention kernel (``moend_attn.cpp``).

The extension is compiled once with ``torch.utils.cpp_extension.load`` into
``$MOEND_CACHE/torch_extensions/moend_attn_<hash>`` (default ``~/.cache/moend/...``); the hash covers the
source, the compiler flags and the torch version, so an edit or an upgrade rebuilds. ``-mavx2 -mfma -mf16c``
are added only when this CPU reports those flags. If the compiler is missing or the build fails, one
warning is issued and :func:`available` returns False: callers then use the reference path.

Set ``MOEND_CPU_KERNEL=0`` to skip the build and always use the reference.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("moend_attn.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "error": None}


def cache_root() -> Path:
    """``$MOEND_CACHE`` else ``~/.cache/moend``."""
    env = os.environ.get("MOEND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moend"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compile_flags() -> list[str]:
    """-O3, plus AVX2/FMA/F16C only when this CPU has them (CI builds on the machine that runs it)."""
    flags = ["-O3", "-fopenmp-simd"]
    if {"avx2", "fma", "f16c"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def _build_name(flags: list[str]) -> str:
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return f"moend_attn_{h.hexdigest()[:12]}"


def _compile() -> None:
    """Compile (or reuse) the extension and load it; registers ``torch.ops.moend_cpu.packed_attention``."""
    from torch.utils.cpp_extension import load

    flags = compile_flags()
    name = _build_name(flags)
    build_dir = cache_root() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(build_dir),
         is_python_module=False, verbose=False)


def available() -> bool:
    """True once the C++ kernel is built and loaded; builds it on the first call (thread-safe)."""
    if _state["tried"]:
        return bool(_state["ok"])
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        if os.environ.get("MOEND_CPU_KERNEL", "1") == "0":
            _state.update(tried=True, ok=False, error="disabled by MOEND_CPU_KERNEL=0")
            return False
        try:
            _compile()
            ok = hasattr(torch.ops.moend_cpu, "packed_attention")
            err = None if ok else "the extension loaded but did not register moend_cpu::packed_attention"
        except Exception as e:  # compiler missing, build error, load error: all mean "use the reference"
            ok, err = False, f"{type(e).__name__}: {e}"
        if not ok:
            warnings.warn(f"moend_fx: the fused CPU attention kernel is unavailable ({str(err)[:500]}); "
                          "using the slower reference attention instead", RuntimeWarning, stacklevel=2)
        _state.update(tried=True, ok=ok, error=err)
        return ok


def build_error() -> str | None:
    """Why the kernel is unavailable (None if it built or was never tried)."""
    return _state["error"]  # type: ignore[return-value]


def _reset() -> None:
    """Forget the build outcome (tests use this to simulate a failing build)."""
    _state.update(tried=False, ok=False, error=None)


def packed_attention_cpu(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    num_splits: int = 0,
) -> torch.Tensor:
    """Call the C++ kernel (must be :func:`available`). Shapes as in ``ops.packed_attention_op``.

    num_splits: token splits per (batch, KV head); 0 = chosen from the thread count and the length.
    Returns fp32 [B, H, L, D].
    """
    return torch.ops.moend_cpu.packed_attention(
        q.float().contiguous(), k_packed.contiguous(), k_scale.contiguous(), k_zero.contiguous(),
        v_packed.contiguous(), v_scale.contiguous(), v_zero.contiguous(), k_res.contiguous(),
        v_res.to(k_res.dtype).contiguous(), int(k_bits), int(v_bits), int(group_size), float(scale),
        bool(causal), int(num_splits))
