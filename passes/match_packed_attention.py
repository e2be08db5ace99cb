"""The pattern ``fuse_quantized_attention`` rewrites, matched on one SDPA node (not a pass: it never edits a graph).

:func:`match_packed_attention` reads ``dequantize -> cat with residual -> SDPA`` (see the pass's module doc) into a
:class:`PackedAttentionMatch`, or raises :class:`NoFuse` saying why this node is not that pattern. Sizes whose
relation cannot be proven from the example values are accepted: the op checks its inputs at run time. The
``attn_mask`` is read into the op's ``mask`` and ``causal`` by :mod:`.match_mask`.

Raw K/V (a 16-bit side, the residual window) are stored in 16 bits (fp16 for an fp32 model), so the graph widens
them to q's dtype: a quantized side's ``cat`` promotes the residual, a raw side's ``cat`` is cast as a whole. The
match reads through such widening casts to the stored tensors, which the kernels take as they are (they compute
in fp32, so a widening cast changes no value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moend_fx.common.options import QuantMode
from moend_fx.storage.quant import OP_MODE, packed_width, scale_shape

from .common import (
    CAST_METHODS,
    CAST_TARGETS,
    CAT_TARGETS,
    NoFuse,
    dtype_of,
    is_call,
    is_dequantize,
    is_method,
    sdpa_args,
    shape_of,
    surely_differ,
    value,
)
from .match_mask import mask_and_causal

__all__ = ["NoFuse", "PackedAttentionMatch", "Side", "match_packed_attention", "read_side"]

# SDPA forms with F.scaled_dot_product_attention's signature (the aten backend variants order arguments
# differently).
_FUSABLE_SDPA = frozenset({
    torch._C._nn.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
})
_DEQ_ARGS = ("codes", "scale", "zero", "bits", "group_size", "mode", "head_dim", "dtype")
# (stored, computed) dtypes of a cast that changes no value: 16-bit storage read as fp32.
_EXACT_CASTS = frozenset({(torch.float16, torch.float32), (torch.bfloat16, torch.float32)})


@dataclass(frozen=True)
class Side:
    """K or V as the kernel reads it: the packed codes (or, 16-bit, the raw graph tensor), their scale and zero
    (None when raw), the residual window, and the constants of its ``moend.dequantize`` (bits 16 when raw)."""

    name: str
    packed: fx.Node
    scale: fx.Node | None
    zero: fx.Node | None
    res: fx.Node
    bits: int
    group_size: int | None = None
    head_dim: int | None = None

    @property
    def raw(self) -> bool:
        return self.bits == 16


@dataclass(frozen=True)
class PackedAttentionMatch:
    """One SDPA node that ``moend.packed_attention`` can replace: its arguments, read from the graph."""

    q: fx.Node
    k: Side
    v: Side
    group_size: int
    head_dim: int
    scale: float
    causal: bool
    mask: fx.Node | None = None  # the op's padding mask (bool [B, 1 or H, L, S]), ANDed with causal


def _deq_args(node: fx.Node) -> dict[str, Any]:
    out = dict(zip(_DEQ_ARGS, node.args))
    out.update(node.kwargs)
    return out


def _split_cat(kv: Any, side: str) -> tuple[fx.Node, fx.Node]:
    """(packed part, residual) of ``cat([packed, residual], dim=2)``."""
    if not isinstance(kv, fx.Node) or not is_call(kv, CAT_TARGETS):
        raise NoFuse(f"{side} is not cat([packed, residual], dim=2)")
    parts = kv.args[0] if kv.args else kv.kwargs.get("tensors")
    dim = kv.args[1] if len(kv.args) > 1 else kv.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(p, fx.Node) for p in parts):
        raise NoFuse(f"{side} is a cat of {len(parts) if isinstance(parts, (list, tuple)) else '?'} parts, not 2")
    if dim not in (2, -2):
        raise NoFuse(f"{side} is concatenated along dim {dim}, not the token axis 2")
    return parts[0], parts[1]


def _reads_as(stored: torch.dtype | None, dtype: torch.dtype | None) -> bool:
    """Whether a tensor stored in ``stored`` holds exactly the values it has in ``dtype`` (same type or widening)."""
    return stored == dtype or (stored, dtype) in _EXACT_CASTS


def _before_cast(node: Any) -> Any:
    """The tensor ``node`` was cast from when ``node`` is a widening dtype cast (same shape and device: e.g. fp16
    storage read as fp32), else ``node`` itself (also when it is not a graph node)."""
    if not isinstance(node, fx.Node) or not node.args or not (is_method(node, CAST_METHODS)
                                                              or is_call(node, CAST_TARGETS)):
        return node
    src = node.args[0]
    before, after = value(src), value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return node
    same_place = before.device == after.device and before.dim() == after.dim() and not any(
        surely_differ(x, y) for x, y in zip(before.shape, after.shape))
    return src if same_place and (before.dtype, after.dtype) in _EXACT_CASTS else node


def read_side(kv: Any, name: str, mode: QuantMode, dtype: torch.dtype) -> Side:
    """The :class:`Side` that K or V (``kv``, an SDPA argument) is read from, quantized in ``mode`` if at all."""
    # K/V may be the cast of the cat (raw side) and each part a cast of what is stored: read through both
    packed, res = (_before_cast(part) for part in _split_cat(_before_cast(kv), name))
    if is_dequantize(packed):
        a = _deq_args(packed)
        if a["mode"] != OP_MODE[mode]:
            raise NoFuse(f"{name} is quantized with mode {a['mode']}, the kernel expects mode {OP_MODE[mode]} "
                         "(K per channel, V per token)")
        if a["dtype"] != dtype:
            raise NoFuse(f"{name} is dequantized to {a['dtype']}, but q is {dtype}")
        static = {key: a[key] for key in ("bits", "group_size", "head_dim")}
        symbolic = sorted(key for key, x in static.items() if isinstance(x, bool) or not isinstance(x, int))
        if symbolic:
            # A graph of one attention call compiled for several layers (after a graph break) can get the bit
            # width as a symbolic int; the kernel variant must be a constant.
            raise NoFuse(f"{name}'s dequantize has non-constant {symbolic} (a graph shared by several layers)")
        side = Side(name, a["codes"], a["scale"], a["zero"], res, **static)
    elif packed.op in ("placeholder", "get_attr"):
        if dtype_of(packed) != dtype_of(res):  # the kernels read one raw type per side
            raise NoFuse(f"raw {name} has dtype {dtype_of(packed)}, its residual window {dtype_of(res)}")
        side = Side(name, packed, None, None, res, 16)
    else:
        raise NoFuse(f"the packed part of {name} is neither moend.dequantize nor a graph input "
                     f"({packed.op} {packed.target})")
    if not _reads_as(dtype_of(res), dtype):
        raise NoFuse(f"{name}'s residual window has dtype {dtype_of(res)}, which q's {dtype} does not hold exactly")
    return side


def _shapes(side: Side) -> dict[str, tuple[Any, ...]]:
    """The 4-d example shapes of a side's graph tensors, by role (packed, res, and scale / zero when quantized)."""
    out = {}
    for what in ("packed", "res", "scale", "zero"):
        node = getattr(side, what)
        if node is not None:
            s = shape_of(node)
            if s is None or len(s) != 4:
                raise NoFuse(f"{side.name} {what} has no 4-d example value")
            out[what] = s
    return out


def _check_shapes(q: tuple[Any, ...], k: Side, v: Side, group_size: int) -> None:
    """NoFuse unless K's and V's tensors provably may have the layout the kernel reads for q: [B, H, L, D]."""
    b, h, _, d = q
    shapes = {side.name: _shapes(side) for side in (k, v)}
    kr, vr = shapes["K"]["res"], shapes["V"]["res"]
    hkv = kr[1]
    # V's residual is K's (V split like K) or holds no token (V packed on arrival: its packed part has P + R)
    v_arrival = statically_known_true(vr[2] == 0)
    v_like_k = (*kr[:2], 0, kr[3]) if v_arrival else kr
    if surely_differ(kr[0], b) or surely_differ(kr[3], d) or any(surely_differ(x, y) for x, y in zip(v_like_k, vr)):
        raise NoFuse(f"residual windows {kr} / {vr} do not fit q {q}")
    if isinstance(h, int) and isinstance(hkv, int) and (hkv == 0 or h % hkv):
        raise NoFuse(f"query heads {h} are not a multiple of KV heads {hkv}")
    p = shapes["K"]["packed"][2]
    for side, mode in ((k, QuantMode.CHANNEL), (v, QuantMode.TOKEN)):
        n = p + kr[2] if side is v and v_arrival else p
        ps = shapes[side.name]["packed"]
        width = d if side.raw else packed_width(d, side.bits)
        if any(surely_differ(x, y) for x, y in zip(ps, (b, hkv, n, width))):
            raise NoFuse(f"{side.name} packed part {ps} does not fit [B={b}, Hkv={hkv}, P={n}, {width}]")
        if side.raw:
            continue
        if side.head_dim != d:
            raise NoFuse(f"{side.name} is dequantized to head_dim {side.head_dim}, q has {d}")
        want = scale_shape(mode, b, hkv, n, d, group_size)
        for what in ("scale", "zero"):
            s = shapes[side.name][what]
            if any(surely_differ(x, y) for x, y in zip(s, want)):
                raise NoFuse(f"{side.name} {what} {s} does not fit {want}")


def _check_sdpa_options(a: dict[str, Any]) -> None:
    """NoFuse for the SDPA options the kernel has no counterpart for."""
    if a["dropout_p"] not in (0, 0.0):
        raise NoFuse(f"dropout_p={a['dropout_p']} (the kernel has no dropout)")
    if a["is_causal"] is not False:
        raise NoFuse("is_causal=True aligns the mask top-left; only the bottom-right causal mask is fused")


def _group_size(k: Side, v: Side) -> int:
    """The one group size of the quantized sides."""
    gs = {s.group_size for s in (k, v) if not s.raw}
    if len(gs) != 1:
        raise NoFuse(f"K and V use different group sizes {sorted(gs)}")
    return gs.pop()


def _scale(scale: Any, head_dim: int) -> float:
    """SDPA's softmax scale as a constant (its default 1 / sqrt(D) when None)."""
    if isinstance(scale, fx.Node):
        raise NoFuse("scale is computed in the graph")
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def match_packed_attention(node: fx.Node) -> PackedAttentionMatch:
    """The fusable pattern around the SDPA node ``node``; :class:`NoFuse` (with the reason) when it is not one."""
    if node.target not in _FUSABLE_SDPA:
        raise NoFuse(f"{node.target} is a backend-specific SDPA variant (other argument order); not fused")
    a = sdpa_args(node)
    q = a["query"]
    q_shape, q_dtype = shape_of(q), dtype_of(q)
    if q_shape is None or len(q_shape) != 4:
        raise NoFuse("q has no 4-d example value")
    k = read_side(a["key"], "K", QuantMode.CHANNEL, q_dtype)
    v = read_side(a["value"], "V", QuantMode.TOKEN, q_dtype)
    if k.raw and v.raw:
        raise NoFuse("K and V are both 16-bit: plain SDPA is the kernel for this layer")
    _check_sdpa_options(a)
    group_size = _group_size(k, v)
    h, d = q_shape[1], q_shape[3]
    res_shape = shape_of(k.res)
    if not a.get("enable_gqa") and res_shape and surely_differ(h, res_shape[1]):
        raise NoFuse("enable_gqa is False but q and K have different head counts")
    if not isinstance(d, int):
        raise NoFuse("head_dim is symbolic")
    _check_shapes(q_shape, k, v, group_size)
    mask, causal = mask_and_causal(a["attn_mask"], q_shape, shape_of(a["key"])[2])
    return PackedAttentionMatch(q, k, v, group_size, d, _scale(a["scale"], d), causal, mask)
