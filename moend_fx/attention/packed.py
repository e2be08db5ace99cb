"""Attention over one compressed layer written as the plain torch ops the ``moend`` backend recognises.

Eager, this is "dequantize the packed part, append the residual window, run SDPA": correct everywhere, but
it materialises the whole layer every step. Under ``torch.compile(backend="moend")`` the graph pass
``fuse_quantized_attention`` finds exactly this shape of graph::

    moend.dequantize(k codes) -> cat([., k_res], 2) \\
    moend.dequantize(v codes) -> cat([., v_res], 2)  -> scaled_dot_product_attention(q, k, v, mask, scale)

and replaces it with one ``torch.ops.moend.packed_attention`` node that reads the packed codes directly.
So the cache's attention function must call :func:`packed_layer_attention` (not ``layer.dequantize()``,
whose ``.to``/``cat`` order differs) for the compiled path to be fused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moend_fx.attention.reference import chunk_causal_mask
from moend_fx.common.errors import MoendError
from moend_fx.storage.packed import Block, PackedKV
from moend_fx.storage.quant import dequantize


def _side(block: Block, res: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, P + R, D] in ``dtype``: the packed tokens (decoded) followed by the residual window.

    Raw K/V are stored in 16 bits (fp16 for an fp32 model) and read in q's dtype; the fusion pass reads through
    both forms below to the stored tensors."""
    if isinstance(block, torch.Tensor):
        # A raw block is stored like its residual: one cat, then one cast (none for a 16-bit model, so its graph is
        # the plain cat). Not a cast of the block alone: an empty block has zero strides (the row-major products
        # of its sizes, see PackedKV), from which a compiled graph cannot derive a cast's strides.
        kv = torch.cat([block, res], dim=2)
        return kv if kv.dtype == dtype else kv.to(dtype)
    # cat widens a 16-bit residual to the dequantized dtype itself (type promotion: exact, and no cast node)
    return torch.cat([dequantize(block, dtype), res], dim=2)


def packed_layer_attention(
    q: torch.Tensor, layer: PackedKV, *, scale: float | None = None, causal: bool = True,
    mask: torch.Tensor | None = None, causal_chunk: bool | None = None,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over every token of ``layer`` (K/V [B, Hkv, n, D]); returns [B, H, L, D].

    causal: the L queries are the newest L of the n held tokens (bottom-right causal mask); ignored for L = 1.
    mask: optional bool [B, 1 or H, L, n] (True = may attend), e.g. padding; combined with the causal mask.
    causal_chunk: alias of ``causal`` (overrides it when given), so this function is a drop-in
    ``attention_fn`` with :func:`moend_fx.attention.reference.reference_attention`'s signature.
    Dequantizes in q's dtype (the model dtype) and reads the 16-bit raw K/V in it. For a multi-token chunk, append
    the chunk to ``layer`` first.
    """
    if causal_chunk is not None:
        causal = causal_chunk
    if q.dim() != 4:
        raise MoendError(f"q must be [B, H, L, D]; got shape {tuple(q.shape)}")
    b, h, n_q, d = q.shape
    kv_b, hkv, _, kv_d = layer.k_res.shape
    if kv_b != b or kv_d != d or h % hkv:
        raise MoendError(f"q {tuple(q.shape)} does not fit the layer's K/V [B={kv_b}, Hkv={hkv}, n, D={kv_d}] "
                         "(need the same B and D, H a multiple of Hkv)")
    k, v = [_side(block, res, q.dtype) for block, res in zip(layer.blocks(), layer.residuals())]
    attn_mask = None
    if causal and n_q > 1:
        attn_mask = chunk_causal_mask(n_q, k.shape[2], q.device)
    if mask is not None:
        attn_mask = mask if attn_mask is None else (mask & attn_mask)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(d) if scale is None else scale, enable_gqa=True,
    )
