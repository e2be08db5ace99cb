"""Pass 1: find every attention node and tag it with its decoder-layer index.

Recognised forms:

* ``scaled_dot_product_attention`` as dynamo records it (``torch._C._nn.scaled_dot_product_attention``), or
  its aten forms (with or without ``attn_mask``, GQA or not): tagged kind ``"sdpa"``;
* the eager pattern ``matmul(q, k^T) -> [scale / mask / cast] -> softmax -> [cast / dropout] -> matmul(., v)``
  (HF's ``eager_attention_forward``): the output matmul is tagged kind ``"eager"``;
* an already fused ``moend.packed_attention`` node: kind ``"packed"`` (so running the passes twice is harmless).

Layer index, in order of preference: the node's module path (``nn_module_stack``, e.g.
``L['self'].model.layers.7.self_attn`` -> 7); else the names of the graph inputs it reads
(``L_cache_layers_7_k_res`` -> 7); else its order among the attention nodes of this graph (logged as a
warning: with a graph break that order is not the layer index, so ``validate_plan`` may reject it).

Must not fire on: a matmul-softmax-matmul whose softmax is not over the last axis, or whose second matmul does
not consume the softmax as its left operand (not attention). It only tags nodes; it never changes the graph.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from .common import (
    CAT_TARGETS,
    META_KIND,
    META_LAYER,
    META_LAYER_SOURCE,
    is_call,
    is_dequantize,
    is_elementwise,
    is_matmul,
    is_method,
    is_sdpa,
    is_softmax,
    layer_index_from_path,
    module_path,
)
from .debug import log

if TYPE_CHECKING:
    from moend_fx.compile.settings import BackendSettings

_MAX_HOPS = 6  # casts / scaling / masking ops allowed between the matmuls and the softmax


def _is_packed_attention(node: fx.Node) -> bool:
    target = getattr(node.target, "_name", None) or getattr(node.target, "__name__", "")
    return node.op == "call_function" and str(target).startswith("moend::packed_attention")


def _softmax_dim(node: fx.Node) -> Any:
    """The ``dim`` of a softmax node: its second argument in every form (``x.softmax(dim)``, ``F.softmax(x, dim)``,
    ``aten._softmax(x, dim, half_to_float)``), or the keyword."""
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)


def _eager_attention_output(softmax: fx.Node) -> fx.Node | None:
    """The output matmul of a matmul-softmax-matmul chain around ``softmax``, or None."""
    if _softmax_dim(softmax) not in (-1, 3):
        return None
    # Backwards: the scores must come from a matmul, through at most a few elementwise ops.
    cur: Any = softmax.args[0] if softmax.args else None
    for _ in range(_MAX_HOPS):
        if not isinstance(cur, fx.Node):
            return None
        if is_matmul(cur):
            break
        if not is_elementwise(cur):
            return None
        cur = cur.args[0] if cur.args else None
    else:
        return None
    if not (isinstance(cur, fx.Node) and is_matmul(cur)):
        return None
    # Forwards: the probabilities are the left operand of a matmul, through casts / dropout.
    cur = softmax
    for _ in range(_MAX_HOPS):
        users = list(cur.users)
        if len(users) != 1:
            return None
        nxt = users[0]
        if is_matmul(nxt):
            return nxt if nxt.args and nxt.args[0] is cur else None
        if not is_elementwise(nxt) or not nxt.args or nxt.args[0] is not cur:
            return None
        cur = nxt
    return None


_PASS_THROUGH_METHODS = frozenset({"to", "contiguous", "transpose", "reshape", "view", "expand", "unsqueeze",
                                   "float", "half", "bfloat16", "__getitem__", "repeat_interleave"})


def _kv_inputs(node: fx.Node, kind: str) -> list[fx.Node]:
    args = [a for a in node.args[1:3] if isinstance(a, fx.Node)] if kind in ("sdpa", "packed") else []
    if kind == "eager" and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        args = [node.args[1]]
    return args


def _index_from_inputs(node: fx.Node, kind: str) -> int | None:
    """Layer index from the names of the graph inputs (placeholders) K/V are read from, if they agree.

    Walks back from K and V through casts, views, ``cat`` and ``moend.dequantize`` only: past a projection
    every earlier layer would be reached.
    """
    seen: set[fx.Node] = set()
    stack = _kv_inputs(node, kind)
    found: set[int] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            i = layer_index_from_path(str(n.target))
            if i is not None:
                found.add(i)
        elif (is_dequantize(n) or is_call(n, CAT_TARGETS) or is_method(n, _PASS_THROUGH_METHODS)
              or (n.op == "call_function" and n.target is operator.getitem)):
            stack.extend(n.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def find_attention(gm: fx.GraphModule, settings: BackendSettings | None = None) -> fx.GraphModule:
    """Tag attention nodes with ``meta["moend_layer"]`` (int), ``meta["moend_attention"]`` (kind) and
    ``meta["moend_layer_source"]``. Returns the same graph module (no node is added or removed)."""
    found: list[tuple[fx.Node, str]] = []
    for node in gm.graph.nodes:
        if is_sdpa(node):
            found.append((node, "sdpa"))
        elif _is_packed_attention(node):
            found.append((node, "packed"))
        elif is_softmax(node):
            out = _eager_attention_output(node)
            if out is not None:
                found.append((out, "eager"))
    for order, (node, kind) in enumerate(found):
        node.meta[META_KIND] = kind
        if kind == "packed" and META_LAYER in node.meta:
            continue
        path = module_path(node)
        idx = layer_index_from_path(path) if path else None
        source = "module"
        if idx is None:
            idx, source = _index_from_inputs(node, kind), "inputs"
        if idx is None:
            idx, source = order, "order"
            log.warning("moend: attention node %s has no module path or layer-named inputs; assuming layer %d "
                        "from its order in the graph", node.name, order)
        node.meta[META_LAYER] = idx
        node.meta[META_LAYER_SOURCE] = source
        log.debug("moend: attention node %s (%s) -> layer %d (from %s)", node.name, kind, idx, source)
    return gm
