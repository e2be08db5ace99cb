"""Attention over a layer's storage.

``reference``: the plain eager attention every fast path is tested against (the oracle). ``packed``: attention
over a PackedKV written as the dequantize -> attention pattern the compile backend finds and fuses. ``fused``:
the cache's default, the fused op for an eager decode step over a quantized layer, the pattern otherwise."""
