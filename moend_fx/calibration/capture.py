"""Attention hooks: swap a model's attention for a Python function for one forward pass.

transformers 5 looks attention up by name in ``AttentionInterface``; :func:`attention_override` registers a
dispatcher under :data:`CAPTURE_IMPL` once, points it at the caller's function, switches the model to it
(``model.set_attn_implementation``) and always switches back, even on error.

:class:`AttentionCapture` is the calibration hook: it computes each layer's attention with SDPA (so the forward
pass is unchanged) and records what the sensitivity measurement needs: post-RoPE K/V, the last ``window``
queries with their positions, and the layer's pre-RoPE query statistics
(:class:`~moend_fx.eviction.query_stats.QueryStats`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moend_fx.common.checks import check_int
from moend_fx.common.defaults import CALIBRATION_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec

CAPTURE_IMPL = "moend_capture"

# Stack of active handlers: the dispatcher calls the innermost one (nesting works, e.g. capture inside eval).
_HANDLERS: list[Callable[..., tuple[torch.Tensor, None]]] = []
_REGISTERED = False


def _dispatch(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if not _HANDLERS:
        raise MoendError(f"attention implementation {CAPTURE_IMPL!r} was called outside attention_override()")
    return _HANDLERS[-1](module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(CAPTURE_IMPL, _dispatch)
        _REGISTERED = True


def _current_impl(model: Any) -> str:
    return getattr(model.config, "_attn_implementation", None) or "sdpa"


@contextlib.contextmanager
def attention_override(model: Any, fn: Callable[..., tuple[torch.Tensor, None]]) -> Iterator[None]:
    """Run ``model``'s attention through ``fn`` inside the ``with`` block; restore the old implementation after.

    ``fn(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs) -> (out, None)`` with
    query [B, H, L, D] and key/value [B, Hkv, S, D] post-RoPE (before the GQA repeat), ``module.layer_idx``
    the layer, ``kwargs["position_ids"]`` [B, L] when the model passes them; ``out`` is [B, L, H, D].
    """
    if not hasattr(model, "set_attn_implementation"):
        raise MoendError(f"model {type(model).__name__} cannot swap its attention (no set_attn_implementation); "
                         "a transformers 5 PreTrainedModel is needed")
    _register()
    previous = _current_impl(model)
    _HANDLERS.append(fn)
    try:
        model.set_attn_implementation(CAPTURE_IMPL)
        yield
    finally:
        _HANDLERS.remove(fn)
        model.set_attn_implementation(previous)


def sdpa_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """What HF's SDPA attention computes: query [B, H, L, D], key/value [B, Hkv, S, D] -> [B, L, H, D].

    ``attention_mask`` None means causal (top-left aligned, right for a prefill with L == S).
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = attention_mask is None and query.shape[2] > 1
    if causal and query.shape[2] != key.shape[2]:
        raise MoendError(
            f"capture got {query.shape[2]} queries over {key.shape[2]} keys without a mask; "
            "calibration runs one prefill without a cache (use_cache=False)"
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def query_positions(kwargs: dict[str, Any], batch: int, length: int, device: Any) -> torch.Tensor:
    """Positions [B, L] int64 of the current queries (``position_ids`` if the model passed them)."""
    pos = kwargs.get("position_ids")
    if pos is None:
        return torch.arange(length, device=device).expand(batch, length)
    return pos.to(device=device, dtype=torch.int64).expand(batch, length)


@dataclass
class LayerCapture:
    """What one layer saw in one prefill.

    keys, values: [B, Hkv, T, D] post-RoPE; queries: [B, H, W, D] post-RoPE, the last W tokens' queries;
    query_positions: [B, W] int64; key_positions: [B, T] int64; scaling: the softmax scale the model used.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    scaling: float

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]


class AttentionCapture:
    """Record every layer's K/V, last-window queries and pre-RoPE query statistics during one prefill.

    Use::

        cap = AttentionCapture(model, window=CALIBRATION_WINDOW, rope=rope_from_model(model), stats=stats)
        with cap:
            model(input_ids=ids, use_cache=False)
        layer0 = cap.layers[0]

    ``stats`` (optional): a dict layer -> :class:`QueryStats` updated in place with the un-rotated queries of
    every token (needs ``rope``) but, when K/V are kept, those of the last ``window`` tokens: the statistics a
    scorer ranks keys with are then estimated on other queries than the ones whose error S measures (as at
    inference, where the table's statistics never saw the prompt). Captures live in ``cap.layers`` until the
    caller drops them (``cap.pop(l)``). The attention output is SDPA's, so the forward pass matches the model's
    ``sdpa`` implementation.
    """

    def __init__(self, model: Any, *, window: int = CALIBRATION_WINDOW, rope: RopeSpec | None = None,
                 stats: dict[int, QueryStats] | None = None, keep_kv: bool = True) -> None:
        check_int("window", window)
        if stats is not None and rope is None:
            raise MoendError("query statistics need the model's RoPE (rope=rope_from_model(model))")
        self.model = model
        self.window = window
        self.rope = rope
        self.stats = stats
        self.keep_kv = keep_kv
        self.layers: dict[int, LayerCapture] = {}
        self._ctx: contextlib.AbstractContextManager | None = None

    def _hook(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
        out = sdpa_output(query, key, value, attention_mask, scaling)
        layer = int(module.layer_idx)
        b, h, t, d = query.shape
        pos = query_positions(kwargs, b, t, query.device)
        w = min(self.window, t)
        if self.stats is not None:
            st = self.stats.get(layer)
            if st is None:
                st = self.stats[layer] = QueryStats.empty(h, d)
            seen = t - w if self.keep_kv and t > w else t
            st.accumulate_rotated(query[:, :, :seen].detach(), pos[:, :seen], self.rope)
        if self.keep_kv:
            self.layers[layer] = LayerCapture(
                keys=key.detach(), values=value.detach(),
                queries=query[:, :, t - w:].detach().clone(), query_positions=pos[:, t - w:].clone(),
                key_positions=pos.clone(), scaling=float(scaling if scaling is not None else d**-0.5),
            )
        return out, None

    def pop(self, layer: int) -> LayerCapture:
        if layer not in self.layers:
            raise MoendError(f"no capture for layer {layer}; captured: {sorted(self.layers)}")
        return self.layers.pop(layer)

    def __enter__(self) -> AttentionCapture:
        self.layers = {}
        self._ctx = attention_override(self.model, self._hook)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)
