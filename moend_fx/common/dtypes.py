"""The two storage type rules of a compressed layer, in one place: what a 16-bit side and the residual window are
stored in (:func:`storage_dtype`) and what original positions are stored in (:func:`position_dtype`).

``moend_fx.storage.packed.PackedKV`` stores with them and ``moend_fx.plan.memory`` counts with them, so the
cache's bytes and the memory model's agree by construction. Why these types: ``docs/cache-format.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from moend_fx.common.errors import MoendError

STORAGE_DTYPE = torch.float16
"""What a 16-bit side and the residual window of a model that is not bf16 are stored in. Budgets are counted
against a 16-bit cache, so anything wider wastes bytes; fp16 rather than bf16 because its 10 mantissa bits (bf16
has 7) keep a lossless plan of an fp32 model closest to its full-precision cache, and post-RoPE K/V of these
models are far inside fp16's range (|x| <= 65504)."""

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

POSITION_DTYPES: tuple[torch.dtype, ...] = (torch.int16, torch.int32)
"""Integer types positions may be stored in, narrowest first."""


def as_dtype(dtype: torch.dtype | str, *, error: type[MoendError] = MoendError) -> torch.dtype:
    """A floating-point torch dtype from a dtype or its name (``"float32"``, ``"torch.bfloat16"``: how a model
    fingerprint spells it), else ``error``."""
    found = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise error(f"dtype {dtype!r} is not a floating-point torch dtype; allowed e.g. 'float32', 'bfloat16'")
    return found


def storage_dtype(model_dtype: torch.dtype | str) -> torch.dtype:
    """The 16-bit type a model of ``model_dtype`` stores raw K/V in (16-bit sides, residual window).

    A 16-bit model keeps its own type (bf16 values stored as fp16 could overflow, fp16 ones lose nothing);
    any wider type (fp32, fp64) is stored as :data:`STORAGE_DTYPE`."""
    dtype = as_dtype(model_dtype)
    return dtype if dtype in _SIXTEEN_BIT else STORAGE_DTYPE


def position_dtype(slots: Any) -> torch.dtype:
    """The narrowest integer type of :data:`POSITION_DTYPES` holding positions ``0 .. slots - 1``: int16 up to
    32768 slots (a context of 32768 tokens), else int32.

    slots: how many logical slots a layer has handed out (its logical length; positions are slot indices), an int
    or, in a compiled decode step, a SymInt (the comparison then guards the graph on the side it took)."""
    for dtype in POSITION_DTYPES:
        if slots <= torch.iinfo(dtype).max + 1:
            return dtype
    raise MoendError(f"{slots} slots do not fit any position type {list(POSITION_DTYPES)}")
