"""Readable names of the specialised attention kernel variants.

A variant is one (K bits, V bits, head_dim, group size) combination; its name (``attn_k4_v8_hd64_g32``) is
used in logs, benchmark tables and the names of the FX nodes the ``moend`` backend inserts. Which
implementation runs a variant is a :class:`~moend_fx.common.options.Kernel`.
"""

from __future__ import annotations

from moend_fx.common.checks import check_bits, check_int, check_power_of_two
from moend_fx.common.errors import MoendError

BITS: tuple[int, ...] = (2, 4, 8, 16)
"""Bit widths the kernels take per side: 16 = stored unquantized, 8 / 4 / 2 = packed codes."""


def variant_name(k_bits: int, v_bits: int, head_dim: int, group_size: int) -> str:
    """``attn_k{k_bits}_v{v_bits}_hd{head_dim}_g{group_size}``, e.g. ``attn_k4_v8_hd64_g32``."""
    check_bits("k_bits", k_bits, allowed=BITS, error=MoendError)
    check_bits("v_bits", v_bits, allowed=BITS, error=MoendError)
    check_int("head_dim", head_dim, error=MoendError)
    check_power_of_two("group_size", group_size, error=MoendError)
    return f"attn_k{k_bits}_v{v_bits}_hd{head_dim}_g{group_size}"
