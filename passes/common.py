"""What the passes share: the op targets they look for, node metadata keys, and shape helpers."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

# Node metadata written by the passes (read by later passes and by tests).
META_LAYER = "moend_layer"  # int: the decoder layer an attention node belongs to
META_LAYER_SOURCE = "moend_layer_source"  # "module" | "inputs" | "order": how the index was found
META_KIND = "moend_attention"  # "sdpa" | "eager" | "packed": which form of attention the node is
META_VARIANT = "moend_variant"  # str: kernel variant of a fused node, e.g. "attn_k4_v8_hd64_g32"
META_SKIP = "moend_not_fused"  # str: why the fusion pass left this attention node alone

aten = torch.ops.aten


class NoFuse(Exception):
    """Why one attention node is left alone (not an error: the graph stays correct)."""


SDPA_TARGETS: frozenset[Any] = frozenset({
    torch._C._nn.scaled_dot_product_attention,  # what dynamo records for F.scaled_dot_product_attention
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
})
# Positional order of F.scaled_dot_product_attention's arguments after (q, k, v).
SDPA_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                 "enable_gqa": False}

MATMUL_TARGETS: frozenset[Any] = frozenset({
    torch.matmul, operator.matmul, torch.bmm, aten.matmul.default, aten.bmm.default, aten.mm.default,
})
SOFTMAX_TARGETS: frozenset[Any] = frozenset({
    torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, aten._softmax.default,
    aten.softmax.int, torch.special.softmax,
})
CAT_TARGETS: frozenset[Any] = frozenset({torch.cat, torch.concat, aten.cat.default})
# A dtype cast as dynamo records it (``x.to(torch.float32)``, ``x.float()``) or as aten does.
CAST_METHODS = frozenset({"to", "float", "type"})
CAST_TARGETS: frozenset[Any] = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})
# Ops that may sit between the score matmul, the softmax and the output matmul of eager attention.
_ELEMENTWISE_METHODS = frozenset({"to", "float", "half", "bfloat16", "type_as", "masked_fill", "contiguous",
                                  "mul", "div", "add", "sub", "__mul__", "__truediv__", "__add__"})
_ELEMENTWISE_FUNCS: frozenset[Any] = frozenset({
    operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div, torch.add, torch.sub,
    torch.where, torch.masked_fill, torch.nn.functional.dropout, torch.tanh, aten.mul.Tensor, aten.div.Tensor,
    aten.add.Tensor, aten.where.self, aten._to_copy.default, aten.clone.default,
    torch.ops.prims.convert_element_type.default,
})


def dequantize_op() -> Any:
    """``torch.ops.moend.dequantize`` (registered by ``moend_fx.storage.quant``)."""
    import moend_fx.storage.quant  # noqa: F401  (registers the op)

    return torch.ops.moend.dequantize


def is_call(node: fx.Node, targets: frozenset[Any] | set[Any]) -> bool:
    return node.op == "call_function" and node.target in targets


def is_sdpa(node: fx.Node) -> bool:
    return is_call(node, SDPA_TARGETS)


def is_dequantize(node: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    op = dequantize_op()
    return node.target is op or node.target is op.default


def is_method(node: fx.Node, names: frozenset[str] | set[str]) -> bool:
    return node.op == "call_method" and node.target in names


def is_matmul(node: fx.Node) -> bool:
    return is_call(node, MATMUL_TARGETS) or is_method(node, {"matmul", "__matmul__", "bmm"})


def is_softmax(node: fx.Node) -> bool:
    return is_call(node, SOFTMAX_TARGETS) or is_method(node, {"softmax"})


def is_elementwise(node: fx.Node) -> bool:
    return is_call(node, _ELEMENTWISE_FUNCS) or is_method(node, _ELEMENTWISE_METHODS)


def value(node: Any) -> Any:
    """The example value (a fake tensor, SymInt, ...) recorded for a node: ``val`` (aten graphs) or
    ``example_value`` (dynamo graphs); a plain Python value is returned as is."""
    if isinstance(node, fx.Node):
        return node.meta.get("val", node.meta.get("example_value"))
    return node


def shape_of(node: Any) -> tuple[Any, ...] | None:
    v = value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(node: Any) -> torch.dtype | None:
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def surely_differ(a: Any, b: Any) -> bool:
    """True when two sizes are provably different; unknown symbolic relations count as "not proven"."""
    return statically_known_true(a != b)


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an SDPA node by name (defaults filled in)."""
    out = dict(SDPA_DEFAULTS)
    out.update(zip(SDPA_ARG_NAMES, node.args))
    out.update(node.kwargs)
    return out


# "model.layers.7.self_attn", "L['self'].model.layers[7].self_attn", "L__self___model_layers_7_self_attn"
_LAYER_NAMES = ("layers", "layer", "h", "blocks", "block", "decoder_layers")
_NAMED_INDEX = re.compile(r"(?:^|[.\]'_])(" + "|".join(_LAYER_NAMES) + r")(?:\.|\[|_)(\d+)(?=$|[.\]_])")
_ANY_INDEX = re.compile(r"(?:\.|\[|_)(\d+)(?=$|[.\]_])")


def layer_index_from_path(path: str) -> int | None:
    """The decoder-layer index in a module path or source name, or None.

    A number after a known container name (``layers``, ``h``, ``blocks``...) wins; else the first number.
    """
    m = _NAMED_INDEX.search(path)
    if m:
        return int(m.group(2))
    m = _ANY_INDEX.search(path)
    return int(m.group(1)) if m else None


def module_path(node: fx.Node) -> str | None:
    """The innermost module path of a node (from ``nn_module_stack``), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    last = list(stack.values())[-1]
    return last[0] if isinstance(last, tuple) else str(last)


def attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes tagged by ``find_attention``, in graph order."""
    return [n for n in gm.graph.nodes if META_LAYER in n.meta]
