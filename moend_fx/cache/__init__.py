"""The Hugging Face cache: a RoutingPlan -> compressed storage at generation time.

Takes a plan (and a table's query statistics for the trig scorer); gives :class:`MoENDCache` (one
:class:`~moend_fx.cache.layer.MoENDLayer` per transformer layer, each holding packed K/V and an eviction policy),
``prepare(model, plan)`` so ``model.generate`` builds one, and the ``"moend"`` attention function HF calls."""
