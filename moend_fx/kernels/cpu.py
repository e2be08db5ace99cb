"""Build, cache and call the fused C++ CPU attention kernel (``moend_attn.cpp``).

The extension is compiled once with ``torch.utils.cpp_extension.load`` into
``$MOEND_CACHE/torch_extensions/moend_attn_<hash>`` (default ``~/.cache/moend/...``); the hash covers the
sources (``moend_attn.cpp`` and its headers), the compiler flags and the torch version, so an edit or an
upgrade rebuilds. It is compiled and linked with ``-fopenmp`` when torch's parallel backend is OpenMP, so
``at::parallel_for`` runs on torch's own OpenMP pool (the system libgomp has the soname torch loads: one
runtime); without it ``at::parallel_for`` is a serial loop. ``-mavx2 -mfma -mf16c`` are added only when this
CPU reports those flags (else the portable loops are compiled), and ``-mavx512f -mavx512bw -mavx512vl`` (with
``-mavx512vnni``, and ``-mavx512vbmi`` beside it, where present) on top of them when it has AVX-512 too
(``moend_attn_avx512.h``). If the
compiler is missing or the build fails, one warning is issued and :func:`available` returns False: callers then
use the reference path.

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
HEADERS = tuple(SOURCE.with_name(f"moend_attn_{part}.h") for part in ("simd", "loops", "avx512"))
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl"]  # the AVX-512 tier needs all three
VNNI_FLAG = "-mavx512vnni"  # the AVX-512 tier's K loop over 16 tokens per register (vpdpbusd)
VBMI_FLAG = "-mavx512vbmi"  # with VNNI: the integer V loop (byte permutes of 4 tokens' codes)
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


def torch_uses_openmp() -> bool:
    """Whether torch's intra-op pool is OpenMP (then the kernel is built with -fopenmp to share it)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def compile_flags(avx2: bool | None = None, avx512: bool | None = None, vnni: bool | None = None) -> list[str]:
    """-O3 (+ -fopenmp when torch uses OpenMP), plus AVX2/FMA/F16C when this CPU has them (CI builds on the
    machine that runs it), plus AVX-512 F/BW/VL (+ VNNI, + VBMI) when it has those too. ``avx2=False`` forces the
    portable loops, ``avx512=False`` the AVX2 ones, ``vnni=False`` the AVX-512 tier's pair K loop and float V
    loop (tests)."""
    flags = ["-O3", "-fopenmp" if torch_uses_openmp() else "-fopenmp-simd"]
    have = _cpu_flags()
    if avx2 is None:
        avx2 = {"avx2", "fma", "f16c"} <= have
    if not avx2:
        return flags
    if avx512 is None:
        avx512 = {"avx512f", "avx512bw", "avx512vl"} <= have
    if not avx512:
        return flags + AVX2_FLAGS
    if vnni is None:
        vnni = "avx512_vnni" in have
    if not vnni:
        return flags + AVX2_FLAGS + AVX512_FLAGS
    return flags + AVX2_FLAGS + AVX512_FLAGS + [VNNI_FLAG] + ([VBMI_FLAG] if "avx512vbmi" in have else [])


def _build_name(flags: list[str], prefix: str = "moend_attn") -> str:
    h = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def build(flags: list[str], namespace: str = "moend_cpu") -> Path:
    """Compile (or reuse) the extension with ``flags`` and load it: registers
    ``torch.ops.<namespace>.packed_attention``. Returns the built library's path."""
    from torch.utils.cpp_extension import load

    defines = [] if namespace == "moend_cpu" else [f"-DMOEND_OP_NS={namespace}"]
    name = _build_name(flags + defines, prefix="moend_attn" if not defines else f"moend_attn_{namespace}")
    build_dir = cache_root() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    ldflags = ["-fopenmp"] if "-fopenmp" in flags else []
    load(name=name, sources=[str(SOURCE)], extra_cflags=flags + defines, extra_ldflags=ldflags,
         extra_include_paths=[str(SOURCE.parent)], build_directory=str(build_dir), is_python_module=False,
         verbose=False)
    return build_dir / f"{name}.so"


def _compile() -> None:
    """Build the kernel for this CPU and load it; registers ``torch.ops.moend_cpu.packed_attention``."""
    _state["path"] = build(compile_flags())


def library_path() -> Path | None:
    """The loaded kernel's shared library (None before :func:`available` built it)."""
    return _state.get("path")  # type: ignore[return-value]


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
            warnings.warn(f"moend_fx: the fused CPU attention kernel is unavailable ({error_summary(str(err))}); "
                          "using the slower reference attention instead (the whole message: "
                          "moend_fx.kernels.cpu.build_error())", RuntimeWarning, stacklevel=2)
        _state.update(tried=True, ok=ok, error=err)
        return ok


def error_summary(err: str, limit: int = 500) -> str:
    """The part of a build error that says what went wrong: the compiler's ``error:`` lines (torch's message
    starts with the whole compile command, which filled the old 500-character cut: seen on a GPU machine), else
    the message's end."""
    errors = [ln.strip() for ln in err.splitlines() if "error:" in ln and not ln.lstrip().startswith("[")]
    text = " | ".join(errors[:3]) if errors else err.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


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
    mask: torch.Tensor | None = None, num_splits: int = 0,
) -> torch.Tensor:
    """Call the C++ kernel (must be :func:`available`). Shapes as in ``ops.packed_attention_op``.

    mask: bool [B, 1 or H, L, S] (True = may attend) or None; read in place when its last dim is contiguous
    (a broadcast or sliced mask is not copied).
    num_splits: token splits per (batch, KV head); 0 = chosen from the thread count and the length.
    Returns fp32 [B, H, L, D].
    """
    if mask is not None and mask.shape[-1] > 1 and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return torch.ops.moend_cpu.packed_attention(
        q.float().contiguous(), k_packed.contiguous(), k_scale.contiguous(), k_zero.contiguous(),
        v_packed.contiguous(), v_scale.contiguous(), v_zero.contiguous(), k_res.contiguous(),
        v_res.to(k_res.dtype).contiguous(), int(k_bits), int(v_bits), int(group_size), float(scale),
        bool(causal), mask, int(num_splits))
