"""Compressed K/V storage of one layer.

Takes dense K/V [B, Hkv, T, D] and a layer config; gives bit-packed asymmetric min/max codes (K per channel with
groups along tokens, V per token with groups along head_dim) with their fp16 scales and zeros, the kept tokens'
positions and the 16-bit residual window (:class:`~moend_fx.storage.packed.PackedKV`), plus the
operations everyone else needs on it (dequantize, gather tokens, index the batch, count bytes)."""
