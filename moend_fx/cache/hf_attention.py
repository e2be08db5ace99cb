"""The "moend" attention function for Hugging Face models (``AttentionInterface`` + mask interface).

How it reaches the compressed layer: HF attention modules call
``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then ``attention_fn(module, q, k, v, mask, **kwargs)``
with the *same* kwargs dict. :meth:`moend_fx.cache.layer.MoENDLayer.update` stores itself in that dict
under ``"moend_layer"``, so this function receives the layer as a keyword argument.

* staged prefill (empty layer): SDPA over the full prompt K/V (HF's own ``sdpa_attention_forward``, so a
  lossless layer matches DynamicCache bit for bit), then ``layer.finish_prefill`` evicts and compresses.
* chunk / decode: ``layer.attend`` runs ``layer.attention_fn`` (reference attention) over the PackedKV,
  with the logical mask gathered at the kept positions.
* no MoENDCache (no cache, or another cache type): plain SDPA over the given K/V.

The mask interface for "moend" is HF's ``sdpa_mask``: a bool [B, 1, L, S_logical] mask, or None when the
pattern is plainly causal (no padding).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from moend_fx.attention.reference import attention_dense, reference_attention

ATTN_NAME = "moend"


def moend_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [B, H, L, D]; key, value: [B, Hkv, L or S, D] (what the cache layer's update returned);
    attention_mask: [B, 1, L, S_logical] bool or None. Returns ([B, L, H, D], None) as HF expects."""
    layer = kwargs.pop("moend_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    position_ids = kwargs.get("position_ids")
    softcap = kwargs.get("softcap")
    if softcap:  # Gemma 2's logit soft-capping: reference attention, which caps the logits (not fused when compiled)
        if layer.pending_prefill:
            out = attention_dense(query, key, value, scale=scaling, mask=attention_mask, softcap=softcap)
            layer.attention_fn = functools.partial(reference_attention, softcap=softcap)  # its chunks and steps
            layer.finish_prefill(query, attention_mask, position_ids)
            return out.transpose(1, 2).contiguous(), None
    if layer.pending_prefill:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        layer.finish_prefill(query, attention_mask, position_ids)
        return out, None
    out = layer.attend(query, attention_mask, scaling, position_ids)  # [B, H, L, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "moend" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, moend_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


register()
