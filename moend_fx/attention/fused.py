"""The default attention of an eager MoENDCache decode step: the fused op where it serves, the pattern elsewhere.

Eager, :func:`~moend_fx.attention.packed.packed_layer_attention` dequantizes the whole layer every step and
runs SDPA over it (measured on SmolLM2-135M, 14x plan, 2k prompt, one thread: ~230 ms per decode step against
~150-175 ms through the fused op, the same greedy tokens). :func:`fused_layer_attention` calls the fused op
``torch.ops.moend.packed_attention`` (C++ on CPU, Triton on CUDA) for a few query rows over a quantized layer,
and hands everything else to ``packed_layer_attention``:

* while dynamo traces (``torch.compile``): the graph must hold the dequantize -> SDPA pattern, so the backend's
  options (``fuse``, ``kernel``) decide what runs, as before;
* a layer whose K and V are both 16-bit: plain SDPA, so a lossless plan stays token-identical to
  ``DynamicCache``;
* a prefill chunk of more than :data:`FUSED_MAX_QUERIES` queries (SDPA's matrix products beat a decode kernel
  there), a mask that is not bool, a device the op has no kernel for.

The op's K dot rounds the query to int16 (``moend_fx.kernels.precision``: logits within ``kernel_atol``), so
this path is not bit-equal to the pattern; pass ``attention_fn=packed_layer_attention`` to ``MoENDCache`` (or
``prepare``) for the plain-torch path, or :func:`moend_fx.attention.reference.reference_attention` for the fp32
oracle.
"""

from __future__ import annotations

import importlib.util

import torch

from moend_fx.attention.packed import packed_layer_attention
from moend_fx.storage.packed import PackedKV

FUSED_MAX_QUERIES = 16  # decode steps and speculative chunks; a prefill chunk stays on SDPA


def _op_serves(device: torch.device) -> bool:
    """Whether ``moend.packed_attention`` has a kernel for ``device`` (CPU always: it falls back to the reference
    itself where the C++ build is unavailable; CUDA when Triton is installed)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def fused_layer_attention(
    q: torch.Tensor, layer: PackedKV, *, scale: float | None = None, causal: bool = True,
    mask: torch.Tensor | None = None, causal_chunk: bool | None = None,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over every token of ``layer`` (K/V [B, Hkv, n, D]); returns [B, H, L, D].

    Arguments as :func:`~moend_fx.attention.packed.packed_layer_attention` (mask: bool [B, 1 or H, L, n], True =
    may attend). Runs the fused op or that function, as the module docstring says.
    """
    if causal_chunk is not None:
        causal = causal_chunk
    cfg = layer.config
    fused = (not torch.compiler.is_compiling() and q.dim() == 4 and q.shape[2] <= FUSED_MAX_QUERIES
             and (cfg.k_bits < 16 or cfg.v_bits < 16) and (mask is None or mask.dtype == torch.bool)
             and _op_serves(q.device))
    if not fused:
        return packed_layer_attention(q, layer, scale=scale, causal=causal, mask=mask)
    from moend_fx.kernels.ops import packed_attention  # registers the op on first use

    return packed_attention(q, layer, scale=scale, causal=causal, mask=mask)
