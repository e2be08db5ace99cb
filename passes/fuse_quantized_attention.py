"""Pass 3: replace ``dequantize -> cat with residual -> SDPA`` with one ``moend.packed_attention`` node.

The pattern (what :func:`moend_fx.attention.packed.packed_layer_attention` traces to)::

    k = cat([moend.dequantize(k_codes, k_scale, k_zero, kb, G, 0, D, dtype), k_res], dim=2)
        | cat([k_raw, k_res], dim=2)[.to(dtype)]
    v = cat([moend.dequantize(v_codes, v_scale, v_zero, vb, G, 1, D, dtype), v_res], dim=2)
        | cat([v_raw, v_res], dim=2)[.to(dtype)]
    out = scaled_dot_product_attention(q, k, v, attn_mask=None | causal | pad & causal | pad, scale=s,
                                       enable_gqa=True)   # causal = ones(L, S).tril(S - L); pad: bool [B, 1|H, L, S]

becomes ``out = moend.packed_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, kb, vb,
G, s, causal, mask)`` (``causal`` for the bottom-right part, ``mask`` the padding mask or None: see
:mod:`.match_mask`; a quantized V is packed on arrival, so its ``v_res`` holds no token), a node named after its
kernel variant and layer (``attn_k4_v8_hd64_g32_layer7``). The kernel reads the packed codes directly: the layer is
never dequantized into a full-precision copy. Raw K/V are passed as stored (16-bit), before the graph widens them
to q's dtype (an fp32 q: the ``cat`` promotes a 16-bit residual, a raw side's ``cat`` is cast, ``.to(dtype)``
above).
The dead dequantize / cat / cast / mask nodes are removed by the clean-up.

Must not fire (the SDPA node is left as is, with the reason in ``node.meta["moend_not_fused"]``) when:

* neither K nor V is read through ``moend.dequantize`` (a 16/16 layer, or dense K/V): plain SDPA is already
  the right kernel;
* K or V is not exactly ``cat([packed, residual], dim=2)``, or the packed part is neither a
  ``moend.dequantize`` nor a raw graph tensor, or a raw tensor does not hold exactly q's values (a cast other
  than 16-bit storage widened to fp32), or a raw side and its residual window are stored in different types;
* ``attn_mask`` is anything but None, the bottom-right causal mask ``ones(L, S).tril(S - L)``, a bool
  ``[B, 1 or H, L, S]`` mask (padding) or the AND of the two (e.g. a float additive mask, or a mask that only
  broadcasts to that shape), or ``is_causal=True`` (top-left aligned), or ``dropout_p != 0``;
* shapes provably do not fit the kernel's layout (batch, KV heads, head_dim, packed length, group sizes,
  K grouped per channel and V per token, dtype of the dequantized values == q's dtype, H a multiple of Hkv);
* ``settings.fuse`` is False.
Symbolic sizes whose relation cannot be proven are accepted: the op checks its inputs at run time. The matching
lives in :mod:`.match_packed_attention`; this module rewrites what it matched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from moend_fx.common.errors import MoendError
from moend_fx.common.options import Kernel
from moend_fx.kernels.variants import variant_name

from .common import META_KIND, META_LAYER, META_SKIP, META_VARIANT, attention_nodes, value
from .debug import log
from .match_packed_attention import NoFuse, PackedAttentionMatch, Side, match_packed_attention

if TYPE_CHECKING:
    from moend_fx.compile.settings import BackendSettings

# Metadata the fused node takes over from the SDPA node it replaces: where it came from, and its example value
# (same shape and dtype as the SDPA output: [B, H, L, D], q's dtype).
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "val", "example_value")


def packed_attention_target(settings: BackendSettings | None) -> Any:
    """The callable the fused node calls for ``settings.kernel``.

    ``auto`` / ``cpu`` / ``triton``: the ``moend::packed_attention`` op, whose device dispatch picks the C++
    kernel for CPU tensors and Triton for CUDA tensors (the device is checked by the pass); ``reference``:
    plain torch ops (dequantize everything, then fp32 attention), traced by the inner compiler.
    """
    import moend_fx.kernels.ops as ops  # registers moend::packed_attention

    if getattr(settings, "kernel", Kernel.AUTO) == Kernel.REFERENCE:
        return ops.reference_packed_attention
    return torch.ops.moend.packed_attention.default


def _check_device(kernel: str, device: torch.device) -> None:
    """A kernel pinned to one device type cannot run attention on another: a user error, not a reason to skip."""
    if kernel == Kernel.CPU and device.type != "cpu":
        raise MoendError(f"kernel='cpu' but the attention runs on {device}; allowed here: 'auto', 'triton', "
                         "'reference'")
    if kernel == Kernel.TRITON and device.type != "cuda":
        raise MoendError(f"kernel='triton' inside a compiled graph needs CUDA tensors, got {device}; "
                         "allowed here: 'auto', 'cpu', 'reference'")


def _side_args(g: fx.Graph, side: Side, device: torch.device) -> list[Any]:
    """(packed, scale, zero) of one side as op arguments."""
    if not side.raw:
        return [side.packed, side.scale, side.zero]
    # The op's schema wants tensors: a 16-bit side passes empty fp16 scales / zeros.
    empty = g.call_function(torch.empty, ((0,),), {"dtype": torch.float16, "device": device})
    empty.meta["example_value"] = torch.empty(0, dtype=torch.float16, device="meta")
    return [side.packed, empty, empty]


def _insert_fused(gm: fx.GraphModule, node: fx.Node, m: PackedAttentionMatch,
                  settings: BackendSettings | None) -> fx.Node:
    """Replace the SDPA ``node`` by one packed-attention node for the match ``m``; returns the new node."""
    kernel = getattr(settings, "kernel", Kernel.AUTO)
    device = value(m.q).device
    _check_device(kernel, device)
    variant = variant_name(m.k.bits, m.v.bits, m.head_dim, m.group_size)
    layer = node.meta[META_LAYER]
    g = gm.graph
    with g.inserting_before(node):
        side_args = _side_args(g, m.k, device) + _side_args(g, m.v, device)
        args = (m.q, *side_args, m.k.res, m.v.res, m.k.bits, m.v.bits, m.group_size, m.scale, m.causal, m.mask)
        fused = g.create_node("call_function", packed_attention_target(settings), args,
                              name=f"{variant}_layer{layer}")
    fused.meta.update({key: node.meta[key] for key in _KEPT_META if key in node.meta})
    fused.meta[META_LAYER] = layer
    fused.meta[META_KIND] = "packed"
    fused.meta[META_VARIANT] = variant
    node.replace_all_uses_with(fused)
    g.erase_node(node)
    log.info("moend: layer %d attention fused into %s (%s, causal=%s, mask=%s)", layer, fused.name, kernel, m.causal,
             m.mask is not None)
    return fused


def fuse_quantized_attention(gm: fx.GraphModule, settings: BackendSettings | None) -> fx.GraphModule:
    """Fuse every SDPA node tagged by ``find_attention`` whose K/V come from packed storage (see module doc)."""
    if not getattr(settings, "fuse", True):
        return gm
    for node in attention_nodes(gm):
        if node.meta.get(META_KIND) != "sdpa":
            continue
        try:
            match = match_packed_attention(node)
        except NoFuse as why:
            node.meta[META_SKIP] = str(why)
            log.debug("moend: layer %s attention %s not fused: %s", node.meta[META_LAYER], node.name, why)
            continue
        _insert_fused(gm, node, match, settings)
    return gm
