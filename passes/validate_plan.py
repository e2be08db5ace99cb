"""Pass 2: check that the routing plan fits the attention layers ``find_attention`` tagged.

Checks, per attention node (shapes from the nodes' fake tensors, ``meta["val"]`` / ``meta["example_value"]``):

* its layer index is one of the plan's layers, and no two attention nodes claim the same layer;
* head_dim (q's last axis) and the number of query heads equal the plan's model fingerprint;
* KV heads: K's head axis equals the fingerprint's ``num_kv_heads`` (or ``num_heads`` when K was already
  expanded for GQA, as HF's eager attention does with ``repeat_kv``);
* when K/V are read through ``moend.dequantize``: its bit width equals the plan's ``k_bits`` / ``v_bits`` for
  that layer and its group size equals the plan's ``group_size``;
* with ``settings.require_all_layers`` (default): the graph holds exactly the plan's layers.

Must not fire when: no plan is given (``settings.plan is None``: nothing to check against), or the graph holds
no attention node at all (e.g. the graph after a break that only runs ``lm_head``). It never changes the graph.
Errors are :class:`moend_fx.common.errors.PlanError` naming the layer, the value found and the value planned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.fx as fx

from moend_fx.common.errors import PlanError

from .common import (
    CAT_TARGETS,
    META_KIND,
    META_LAYER,
    attention_nodes,
    is_call,
    is_dequantize,
    sdpa_args,
    shape_of,
    surely_differ,
)
from .debug import log

if TYPE_CHECKING:
    from moend_fx.compile.settings import BackendSettings


def _kv_nodes(node: fx.Node) -> tuple[Any, Any]:
    if node.meta.get(META_KIND) == "eager":
        # output matmul(probs, v); K is the right operand of the score matmul, not reachable cheaply: V only.
        return None, node.args[1] if len(node.args) > 1 else None
    if node.meta.get(META_KIND) == "packed":
        return None, None
    a = sdpa_args(node)
    return a["key"], a["value"]


def dequantize_feeding(kv: Any) -> fx.Node | None:
    """The ``moend.dequantize`` node whose output is the packed part of ``cat([packed, residual], dim=2)``."""
    if not isinstance(kv, fx.Node) or not is_call(kv, CAT_TARGETS) or not kv.args:
        return None
    parts = kv.args[0]
    if isinstance(parts, (list, tuple)) and parts and is_dequantize(parts[0]):
        return parts[0]
    return None


def _check_bits(layer: int, side: str, deq: fx.Node | None, planned: int, group_size: int) -> None:
    if deq is None:
        return  # raw K/V (16-bit side, prefill over dense K/V, or an uncompressed cache): nothing to compare
    bits, gs = deq.args[3], deq.args[4]
    if bits != planned:
        raise PlanError(f"layer {layer}: the graph reads {side} as {bits}-bit codes but the plan says "
                        f"{side.lower()}_bits={planned}; prepare the model with this plan (moend_fx.prepare)")
    if gs != group_size:
        raise PlanError(f"layer {layer}: the graph's {side} group size is {gs} but the plan's group_size is "
                        f"{group_size}")


def validate_plan(gm: fx.GraphModule, settings: BackendSettings | None) -> fx.GraphModule:
    """Raise :class:`PlanError` if ``settings.plan`` does not fit the tagged attention nodes; else return gm."""
    plan = getattr(settings, "plan", None)
    nodes = attention_nodes(gm)
    if plan is None or not nodes:
        log.debug("moend: validate_plan skipped (%s)", "no plan" if plan is None else "no attention node")
        return gm
    fp = plan.fingerprint
    seen: dict[int, str] = {}
    for node in nodes:
        layer = node.meta[META_LAYER]
        if not 0 <= layer < plan.num_layers:
            raise PlanError(f"attention node {node.name} belongs to layer {layer}, but the plan has layers "
                            f"0..{plan.num_layers - 1}; the plan was made for another model")
        if layer in seen:
            raise PlanError(f"attention nodes {seen[layer]} and {node.name} both belong to layer {layer}; "
                            "expected one attention call per layer")
        seen[layer] = node.name
        q_shape = shape_of(node.args[0]) if node.args else None
        if q_shape is not None and len(q_shape) == 4:
            if surely_differ(q_shape[-1], fp.head_dim):
                raise PlanError(f"layer {layer}: head_dim is {q_shape[-1]} in the graph but "
                                f"{fp.head_dim} in the plan's model; the plan was made for another model")
            if surely_differ(q_shape[1], fp.num_heads):
                raise PlanError(f"layer {layer}: {q_shape[1]} query heads in the graph but num_heads="
                                f"{fp.num_heads} in the plan's model")
        k, v = _kv_nodes(node)
        kv_shape = shape_of(k if k is not None else v) if (k is not None or v is not None) else None
        if kv_shape is not None and len(kv_shape) == 4:
            heads = kv_shape[1]
            if surely_differ(heads, fp.num_kv_heads) and surely_differ(heads, fp.num_heads):
                raise PlanError(f"layer {layer}: {heads} KV heads in the graph but num_kv_heads="
                                f"{fp.num_kv_heads} in the plan's model")
        config = plan.layers[layer]
        _check_bits(layer, "K", dequantize_feeding(k), config.k_bits, plan.group_size)
        _check_bits(layer, "V", dequantize_feeding(v), config.v_bits, plan.group_size)
    if settings.require_all_layers and len(seen) != plan.num_layers:
        missing = sorted(set(range(plan.num_layers)) - set(seen))
        shown = missing[:10] + (["..."] if len(missing) > 10 else [])
        raise PlanError(
            f"this graph holds attention for {len(seen)} of the plan's {plan.num_layers} layers (missing "
            f"{shown}); compile with fullgraph=True, or pass options={{'require_all_layers': False}} when a "
            "graph break splits the decoder"
        )
    return gm
