"""Fused attention over compressed K/V: the ``moend::packed_attention`` op and its kernels.

``packed_attention(q, layer)`` picks the C++ kernel on CPU (reference fallback if it cannot be built) and
Triton on CUDA; :class:`Kernel` names the implementations; ``variant_name`` names a specialisation
(``attn_k4_v8_hd64_g32``). See ``docs/kernels.md``.
"""

from moend_fx.common.options import Kernel
from moend_fx.kernels.ops import layer_tensors, packed_attention, reference_packed_attention
from moend_fx.kernels.variants import variant_name

__all__ = ["Kernel", "layer_tensors", "packed_attention", "reference_packed_attention", "variant_name"]
