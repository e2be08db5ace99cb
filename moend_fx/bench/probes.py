"""Memory probes for the decode benchmark: process RSS (from /proc), weight and cache bytes."""

from __future__ import annotations

import gc
from typing import Any

import torch


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """Current resident set size (None where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def peak_rss_bytes() -> int | None:
    """Peak RSS since the last :func:`reset_peak_rss` (or process start)."""
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS baselines mean something."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied embeddings)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def cache_nbytes(cache: Any) -> tuple[int, int]:
    """(every byte the cache holds, of which eviction state) of a MoENDCache, or (K/V bytes, 0) of any HF cache
    with dense layers."""
    if hasattr(cache, "nbytes") and hasattr(cache, "plan"):
        return int(cache.nbytes().total), int(cache.state_nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total, 0
