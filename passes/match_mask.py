"""The ``mask`` and ``causal`` arguments of ``moend.packed_attention`` for an SDPA ``attn_mask`` (part of the match
of :mod:`.match_packed_attention`; never edits a graph).

What :func:`moend_fx.attention.packed.packed_layer_attention` gives SDPA, and what the op gets for it:

* no mask (a decode step without padding): ``mask=None, causal=False``;
* ``ones(L, S, dtype=bool).tril(S - L)`` (a chunk: bottom-right causal): ``mask=None, causal=True``;
* ``pad & ones(L, S).tril(S - L)`` (either order) with ``pad`` bool ``[B, 1 or H, L, S]``: ``mask=pad,
  causal=True`` (the kernel applies the causal part itself, so the ``ones``/``tril``/``&`` nodes die);
* any other bool ``[B, 1 or H, L, S]`` mask (a padded decode step; a padding operand that only broadcasts to that
  shape is passed as the whole ``&``): ``mask=attn_mask, causal=False``.

A float (additive) mask, or a mask of another shape, is not fused (:class:`NoFuse`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import NoFuse, aten, dtype_of, is_call, is_method, shape_of, surely_differ, value

# A logical AND of two bool masks as dynamo (``a & b``, torch.logical_and) or aten records it.
AND_TARGETS: frozenset[Any] = frozenset({
    operator.and_, torch.logical_and, torch.bitwise_and, aten.logical_and.default, aten.bitwise_and.Tensor,
})
AND_METHODS = frozenset({"__and__", "logical_and", "bitwise_and"})


def is_causal_mask(mask: Any, n_q: Any, n_k: Any) -> bool:
    """True for ``ones(L, S, dtype=bool).tril(S - L)`` (``chunk_causal_mask``) with L, S those of the SDPA."""
    if not isinstance(mask, fx.Node) or not (is_method(mask, {"tril"}) or is_call(mask, {torch.tril})):
        return False
    base = mask.args[0]
    diag = mask.args[1] if len(mask.args) > 1 else mask.kwargs.get("diagonal", 0)
    if not (isinstance(base, fx.Node) and is_call(base, {torch.ones})) or dtype_of(mask) != torch.bool:
        return False
    shape = shape_of(mask)
    diag_val = value(diag)
    if shape is None or len(shape) != 2 or diag_val is None:
        return False
    return (statically_known_true(shape[0] == n_q) and statically_known_true(shape[1] == n_k)
            and statically_known_true(diag_val == n_k - n_q))


def fits_op(mask: Any, q_shape: tuple[Any, ...], n_k: Any) -> bool:
    """Whether ``mask`` may be the op's mask for q: [B, H, L, D] over n_k tokens: bool [B, 1 or H, L, n_k]
    (sizes not provably different)."""
    shape = shape_of(mask)
    if dtype_of(mask) != torch.bool or shape is None or len(shape) != 4:
        return False
    b, h, l, _ = q_shape
    heads_fit = statically_known_true(shape[1] == 1) or not surely_differ(shape[1], h)
    return heads_fit and not any(surely_differ(x, y) for x, y in zip((shape[0], shape[2], shape[3]), (b, l, n_k)))


def _and_operands(mask: fx.Node) -> tuple[Any, Any] | None:
    """The two operands of ``a & b`` (None when ``mask`` is not a logical AND of two tensors)."""
    if not (is_call(mask, AND_TARGETS) or is_method(mask, AND_METHODS)) or len(mask.args) != 2 or mask.kwargs:
        return None
    return mask.args[0], mask.args[1]


def mask_and_causal(attn_mask: Any, q_shape: tuple[Any, ...], n_k: Any) -> tuple[fx.Node | None, bool]:
    """(mask, causal) of the op for SDPA's ``attn_mask`` with q: [B, H, L, D] over n_k tokens (module doc);
    :class:`NoFuse` when the kernel cannot express that mask."""
    n_q = q_shape[2]
    if attn_mask is None:
        return None, False
    if is_causal_mask(attn_mask, n_q, n_k):
        return None, True
    if not isinstance(attn_mask, fx.Node) or dtype_of(attn_mask) != torch.bool:
        raise NoFuse(f"attn_mask has dtype {dtype_of(attn_mask)} (an additive mask); the kernel takes a bool mask")
    operands = _and_operands(attn_mask)
    if operands is not None:
        for pad, other in (operands, operands[::-1]):
            if is_causal_mask(other, n_q, n_k) and fits_op(pad, q_shape, n_k):
                return pad, True
    if fits_op(attn_mask, q_shape, n_k):
        return attn_mask, False
    raise NoFuse(f"attn_mask {shape_of(attn_mask)} is neither the bottom-right causal mask nor a bool "
                 f"[B, 1 or H, L, S] = [{q_shape[0]}, 1 or {q_shape[1]}, {n_q}, {n_k}] mask")
