"""Pass 3: replace ``dequantize -> cat with residual -> SDPA`` with one ``moend.packed_attention`` node.

The pattern (what :func:`moend_fx.attention.packed.packed_layer_attention` traces to)::

    k = cat([moend.dequantize(k_codes, k_scale, k_zero, kb, G, 0, D, dtype) | k_raw, k_res], dim=2)
    v = cat([moend.dequantize(v_codes, v_scale, v_zero, vb, G, 1, D, dtype) | v_raw, v_res], dim=2)
    out = scaled_dot_product_attention(q, k, v, attn_mask=None | ones(L, S).tril(S - L), scale=s, enable_gqa=True)

becomes ``out = moend.packed_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res,
kb, vb, G, s, causal)``, a node named after its kernel variant and layer (``attn_k4_v8_hd64_g32_layer7``). The
kernel reads the packed codes directly: the layer is never dequantized into a full-precision copy. The dead
dequantize / cat / mask nodes are removed by the clean-up.

Must not fire (the SDPA node is left as is, with the reason in ``node.meta["moend_not_fused"]``) when:

* neither K nor V is read through ``moend.dequantize`` (a 16/16 layer, or dense K/V): plain SDPA is already
  the right kernel;
* K or V is not exactly ``cat([packed, residual], dim=2)``, or the packed part is neither a
  ``moend.dequantize`` nor a raw graph tensor, or a raw side is cast on the way (dtype differs);
* ``attn_mask`` is anything but None or the bottom-right causal mask ``ones(L, S).tril(S - L)`` (e.g. a padding
  mask: the kernel takes no mask), or ``is_causal=True`` (top-left aligned), or ``dropout_p != 0``;
* shapes provably do not fit the kernel's layout (batch, KV heads, head_dim, packed length, group sizes,
  K grouped per channel and V per token, dtype of the dequantized values == q's dtype, H a multiple of Hkv);
* ``settings.fuse`` is False.
Symbolic sizes whose relation cannot be proven are accepted: the op checks its inputs at run time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from moend_fx.common.errors import MoendError
from moend_fx.storage.quant import MODE_CHANNEL, MODE_TOKEN, packed_width

from .common import (
    CAT_TARGETS,
    META_KIND,
    META_LAYER,
    META_SKIP,
    META_VARIANT,
    attention_nodes,
    dtype_of,
    is_call,
    is_dequantize,
    is_method,
    sdpa_args,
    shape_of,
    surely_differ,
    value,
)
from .debug import log

# SDPA forms with F.scaled_dot_product_attention's signature (the aten backend variants order arguments
# differently).
_FUSABLE_SDPA = frozenset({
    torch._C._nn.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
})
_DEQ_ARGS = ("codes", "scale", "zero", "bits", "group_size", "mode", "head_dim", "dtype")


class _NoFuse(Exception):
    """Why one attention node is left alone (not an error: the graph stays correct)."""


def packed_attention_target(settings: Any) -> Any:
    """The callable the fused node calls for ``settings.kernel``.

    ``auto`` / ``cpu`` / ``triton``: the ``moend::packed_attention`` op, whose device dispatch picks the C++
    kernel for CPU tensors and Triton for CUDA tensors (the device is checked by the pass); ``reference``:
    plain torch ops (dequantize everything, then fp32 attention), traced by the inner compiler.
    """
    import moend_fx.kernels.ops as ops  # registers moend::packed_attention

    kernel = getattr(settings, "kernel", "auto")
    if kernel == "reference":
        return ops.reference_packed_attention
    return torch.ops.moend.packed_attention.default


def _variant(k_bits: int, v_bits: int, head_dim: int, group_size: int) -> str:
    from moend_fx.kernels import variant_name

    return variant_name(k_bits, v_bits, head_dim, group_size)


def _deq_args(node: fx.Node) -> dict[str, Any]:
    out = dict(zip(_DEQ_ARGS, node.args))
    out.update(node.kwargs)
    return out


def _split_cat(kv: Any, side: str) -> tuple[fx.Node, fx.Node]:
    """(packed part, residual) of ``cat([packed, residual], dim=2)``."""
    if not isinstance(kv, fx.Node) or not is_call(kv, CAT_TARGETS):
        raise _NoFuse(f"{side} is not cat([packed, residual], dim=2)")
    parts = kv.args[0] if kv.args else kv.kwargs.get("tensors")
    dim = kv.args[1] if len(kv.args) > 1 else kv.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(p, fx.Node) for p in parts):
        raise _NoFuse(f"{side} is a cat of {len(parts) if isinstance(parts, (list, tuple)) else '?'} parts, not 2")
    if dim not in (2, -2):
        raise _NoFuse(f"{side} is concatenated along dim {dim}, not the token axis 2")
    return parts[0], parts[1]


def _is_causal_mask(mask: Any, n_q: Any, n_k: Any) -> bool:
    """True for ``ones(L, S, dtype=bool).tril(S - L)`` (``chunk_causal_mask``) with L, S those of the SDPA."""
    if not isinstance(mask, fx.Node):
        return False
    if is_method(mask, {"tril"}) or is_call(mask, {torch.tril}):
        base = mask.args[0]
        diag = mask.args[1] if len(mask.args) > 1 else mask.kwargs.get("diagonal", 0)
    else:
        return False
    if not (isinstance(base, fx.Node) and is_call(base, {torch.ones})):
        return False
    if dtype_of(mask) != torch.bool:
        return False
    shape = shape_of(mask)
    if shape is None or len(shape) != 2:
        return False
    diag_val = value(diag)
    if diag_val is None:
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return (statically_known_true(shape[0] == n_q) and statically_known_true(shape[1] == n_k)
            and statically_known_true(diag_val == n_k - n_q))


class _Side:
    """One of K / V: packed codes (or raw tensor), scale, zero, residual, bits, and the dequantize node."""

    def __init__(self, kv: Any, name: str, mode: int, dtype: torch.dtype) -> None:
        packed, self.res = _split_cat(kv, name)
        self.name = name
        if is_dequantize(packed):
            a = _deq_args(packed)
            if a["mode"] != mode:
                raise _NoFuse(f"{name} is quantized with mode {a['mode']}, the kernel expects mode {mode} "
                              "(K per channel, V per token)")
            if a["dtype"] != dtype:
                raise _NoFuse(f"{name} is dequantized to {a['dtype']}, but q is {dtype}")
            self.packed, self.scale, self.zero = a["codes"], a["scale"], a["zero"]
            static = {key: a[key] for key in ("bits", "group_size", "head_dim")}
            symbolic = sorted(key for key, x in static.items() if isinstance(x, bool) or not isinstance(x, int))
            if symbolic:
                # A graph of one attention call compiled for several layers (after a graph break) can get the bit
                # width as a symbolic int; the kernel variant must be a constant.
                raise _NoFuse(f"{name}'s dequantize has non-constant {symbolic} (a graph shared by several layers)")
            self.bits, self.group_size, self.head_dim = static["bits"], static["group_size"], static["head_dim"]
        elif packed.op == "placeholder" or packed.op == "get_attr":
            if dtype_of(packed) != dtype:
                raise _NoFuse(f"raw {name} has dtype {dtype_of(packed)}, q has {dtype}")
            self.packed, self.scale, self.zero = packed, None, None
            self.bits, self.group_size, self.head_dim = 16, None, None
        else:
            raise _NoFuse(f"the packed part of {name} is neither moend.dequantize nor a graph input "
                          f"({packed.op} {packed.target})")
        if dtype_of(self.res) != dtype:
            raise _NoFuse(f"{name}'s residual window has dtype {dtype_of(self.res)}, q has {dtype}")


def _differ(a: Any, b: Any) -> bool:
    return surely_differ(a, b)


def _check_shapes(q: tuple, k: _Side, v: _Side, group_size: int) -> None:
    b, h, _, d = q
    shapes = {}
    for side in (k, v):
        for what in ("packed", "res", "scale", "zero"):
            node = getattr(side, what)
            if node is not None:
                s = shape_of(node)
                if s is None or len(s) != 4:
                    raise _NoFuse(f"{side.name} {what} has no 4-d example value")
                shapes[(side.name, what)] = s
    kr, vr = shapes[("K", "res")], shapes[("V", "res")]
    hkv = kr[1]
    if _differ(kr[0], b) or _differ(kr[3], d) or any(_differ(x, y) for x, y in zip(kr, vr)):
        raise _NoFuse(f"residual windows {kr} / {vr} do not fit q {q}")
    if isinstance(h, int) and isinstance(hkv, int) and (hkv == 0 or h % hkv):
        raise _NoFuse(f"query heads {h} are not a multiple of KV heads {hkv}")
    p = shapes[("K", "packed")][2]
    gv = min(group_size, d) if isinstance(d, int) else group_size
    for side, mode in ((k, MODE_CHANNEL), (v, MODE_TOKEN)):
        ps = shapes[(side.name, "packed")]
        width = d if side.bits == 16 else packed_width(d, side.bits)
        if _differ(ps[0], b) or _differ(ps[1], hkv) or _differ(ps[2], p) or _differ(ps[3], width):
            raise _NoFuse(f"{side.name} packed part {ps} does not fit [B={b}, Hkv={hkv}, P={p}, {width}]")
        if side.bits == 16:
            continue
        if side.head_dim != d:
            raise _NoFuse(f"{side.name} is dequantized to head_dim {side.head_dim}, q has {d}")
        want = (b, hkv, p // group_size, d) if mode == MODE_CHANNEL else (b, hkv, p, d // gv)
        for what in ("scale", "zero"):
            s = shapes[(side.name, what)]
            if any(_differ(x, y) for x, y in zip(s, want)):
                raise _NoFuse(f"{side.name} {what} {s} does not fit {want}")


def _fuse_one(gm: fx.GraphModule, node: fx.Node, settings: Any) -> fx.Node:
    if node.target not in _FUSABLE_SDPA:
        raise _NoFuse(f"{node.target} is a backend-specific SDPA variant (other argument order); not fused")
    a = sdpa_args(node)
    q = a["query"]
    q_shape, q_dtype = shape_of(q), dtype_of(q)
    if q_shape is None or len(q_shape) != 4:
        raise _NoFuse("q has no 4-d example value")
    k = _Side(a["key"], "K", MODE_CHANNEL, q_dtype)
    v = _Side(a["value"], "V", MODE_TOKEN, q_dtype)
    if k.bits == 16 and v.bits == 16:
        raise _NoFuse("K and V are both 16-bit: plain SDPA is the kernel for this layer")
    if a["dropout_p"] not in (0, 0.0):
        raise _NoFuse(f"dropout_p={a['dropout_p']} (the kernel has no dropout)")
    if a["is_causal"] is not False:
        raise _NoFuse("is_causal=True aligns the mask top-left; only the bottom-right causal mask is fused")
    gs = {s.group_size for s in (k, v) if s.bits != 16}
    if len(gs) != 1:
        raise _NoFuse(f"K and V use different group sizes {sorted(gs)}")
    group_size = gs.pop()
    h, hkv = q_shape[1], shape_of(k.res)[1] if shape_of(k.res) else None
    if not a.get("enable_gqa") and hkv is not None and _differ(h, hkv):
        raise _NoFuse("enable_gqa is False but q and K have different head counts")
    _check_shapes(q_shape, k, v, group_size)
    n_q, n_k = q_shape[2], shape_of(a["key"])[2]
    mask = a["attn_mask"]
    if mask is None:
        causal = False
    elif _is_causal_mask(mask, n_q, n_k):
        causal = True
    else:
        raise _NoFuse("attn_mask is not the bottom-right causal mask (e.g. padding); the kernel takes no mask")
    d = q_shape[3]
    if not isinstance(d, int):
        raise _NoFuse("head_dim is symbolic")
    scale = a["scale"]
    if isinstance(scale, fx.Node):
        raise _NoFuse("scale is computed in the graph")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kernel = getattr(settings, "kernel", "auto")
    device = value(q).device
    if kernel == "cpu" and device.type != "cpu":
        raise MoendError(f"kernel='cpu' but the attention runs on {device}; allowed here: 'auto', 'triton', "
                         "'reference'")
    if kernel == "triton" and device.type != "cuda":
        raise MoendError(f"kernel='triton' inside a compiled graph needs CUDA tensors, got {device}; "
                         "allowed here: 'auto', 'cpu', 'reference'")

    variant = _variant(k.bits, v.bits, d, group_size)
    layer = node.meta[META_LAYER]
    g = gm.graph
    with g.inserting_before(node):
        side_args: list[Any] = []
        for side in (k, v):
            if side.bits == 16:
                # The op's schema wants tensors: a 16-bit side passes empty fp16 scales / zeros.
                empty = g.call_function(torch.empty, ((0,),), {"dtype": torch.float16, "device": device})
                empty.meta["example_value"] = torch.empty(0, dtype=torch.float16, device="meta")
                side_args += [side.packed, empty, empty]
            else:
                side_args += [side.packed, side.scale, side.zero]
        fused = g.call_function(
            packed_attention_target(settings),
            (q, *side_args, k.res, v.res, k.bits, v.bits, group_size, scale, causal),
        )
    fused._rename(f"{variant}_layer{layer}")
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in node.meta:
            fused.meta[key] = node.meta[key]
    for key in ("val", "example_value"):
        if key in node.meta:
            fused.meta[key] = node.meta[key]  # same shape and dtype as the SDPA output: [B, H, L, D], q's dtype
    fused.meta[META_LAYER] = layer
    fused.meta[META_KIND] = "packed"
    fused.meta[META_VARIANT] = variant
    node.replace_all_uses_with(fused)
    g.erase_node(node)
    log.info("moend: layer %d attention fused into %s (%s, causal=%s)", layer, fused.name, kernel, causal)
    return fused


def fuse_quantized_attention(gm: fx.GraphModule, settings: Any) -> fx.GraphModule:
    """Fuse every SDPA node tagged by ``find_attention`` whose K/V come from packed storage (see module doc)."""
    if not getattr(settings, "fuse", True):
        return gm
    for node in attention_nodes(gm):
        if node.meta.get(META_KIND) != "sdpa":
            continue
        try:
            _fuse_one(gm, node, settings)
        except _NoFuse as why:
            node.meta[META_SKIP] = str(why)
            log.debug("moend: layer %s attention %s not fused: %s", node.meta[META_LAYER], node.name, why)
    return gm


