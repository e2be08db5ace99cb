"""A toy decoder for graph tests: 2-3 "layers" whose attention reads a PackedKV through packed_layer_attention.

Shapes stay tiny (4 query heads, 2 KV heads, head_dim 8, 70 tokens -> 64 packed + 6 residual with G = 32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from moend_fx.attention.packed import packed_layer_attention
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.storage.packed import PackedKV

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 32
CONFIGS = {
    "mixed": (LayerConfig(1.0, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 16, 2)),
    "two": (LayerConfig(1.0, 8, 4), LayerConfig(1.0, 4, 2)),
}


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class ToyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor, layer: PackedKV, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)  # [B, H, L, D]
        out = packed_layer_attention(q, layer, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


class ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = ToyAttention()

    def forward(self, x, layer, mask=None):
        return x + self.self_attn(x, layer, mask)


class ToyDecoder(nn.Module):
    """``model.layers.<i>.self_attn``, like HF decoders, so nn_module_stack gives the layer index."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ToyLayer() for _ in range(num_layers))

    def forward(self, x: torch.Tensor, cache: list[PackedKV], mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer, kv in zip(self.layers, cache):
            x = layer(x, kv, mask)
        return x


def eager_attention(q, k, v, mask=None):
    """HF's eager_attention_forward: repeat_kv, matmul, scale, mask, fp32 softmax, dropout, matmul."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


class EagerDecoder(nn.Module):
    """Dense K/V, eager matmul-softmax-matmul attention; a softmax over dim 1 in the head is not attention."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ToyAttention() for _ in range(num_layers))

    def forward(self, x, kv):
        b, n, _ = x.shape
        for attn, (k, v) in zip(self.layers, kv):
            q = attn.q_proj(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
            x = x + attn.o_proj(eager_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return torch.softmax(x, dim=1)


def make_cache(configs, tokens: int = 70, batch: int = 1, seed: int = 0, dtype=torch.float32) -> list[PackedKV]:
    out = []
    for i, c in enumerate(configs):
        k = rand(batch, KV_HEADS, tokens, HEAD_DIM, seed=seed + 2 * i).to(dtype)
        v = rand(batch, KV_HEADS, tokens, HEAD_DIM, seed=seed + 2 * i + 1).to(dtype)
        out.append(PackedKV.from_dense(k, v, c, 32))
    return out


def make_plan(configs, group_size: int = 32, **fp) -> RoutingPlan:
    kw = {"architecture": "Toy", "num_layers": len(configs), "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "num_heads": HEADS}
    kw.update(fp)
    return RoutingPlan(layers=tuple(configs), fingerprint=ModelFingerprint(**kw), budget_bytes=1,
                       context_length=128, group_size=group_size)


def capture(fn: Callable, *args, transform: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
            **kwargs) -> tuple[fx.GraphModule, list, object]:
    """Trace ``fn(*args)`` with dynamo (fullgraph); returns (graph module after ``transform``, example inputs,
    the compiled function's output)."""
    box: dict = {}

    def backend(gm, example_inputs):
        gm = transform(gm) if transform else gm
        box["gm"], box["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return box["gm"], box["inputs"], out


def targets(gm: fx.GraphModule) -> list[str]:
    """Readable call targets of the graph (``moend.packed_attention.default``, ``scaled_dot_product_attention``)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.append(str(getattr(n.target, "__name__", n.target)) if not isinstance(
                n.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket) else str(n.target))
    return out
