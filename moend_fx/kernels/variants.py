"""Readable names and input checks for the specialised attention kernel variants.

A variant is one (K bits, V bits, head_dim, group size) combination; its name (``attn_k4_v8_hd64_g32``) is
used in logs, benchmark tables and the names of the FX nodes the ``moend`` backend inserts.
"""

from __future__ import annotations

from moend_fx.common.errors import MoendError

BITS: tuple[int, ...] = (2, 4, 8, 16)
KERNELS: tuple[str, ...] = ("auto", "cpu", "triton", "reference")


def check_bits(name: str, bits: int) -> int:
    if bits not in BITS:
        raise MoendError(f"{name}={bits!r} is not a supported bit width; allowed: {list(BITS)}")
    return int(bits)


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise MoendError(f"kernel={kernel!r} is unknown; allowed: {list(KERNELS)}")
    return kernel


def variant_name(k_bits: int, v_bits: int, head_dim: int, group_size: int) -> str:
    """``attn_k{k_bits}_v{v_bits}_hd{head_dim}_g{group_size}``, e.g. ``attn_k4_v8_hd64_g32``."""
    check_bits("k_bits", k_bits)
    check_bits("v_bits", v_bits)
    if head_dim <= 0:
        raise MoendError(f"head_dim={head_dim!r} must be a positive integer")
    if group_size <= 0 or group_size & (group_size - 1):
        raise MoendError(f"group_size={group_size!r} is invalid; allowed: a power of two")
    return f"attn_k{k_bits}_v{v_bits}_hd{head_dim}_g{group_size}"
