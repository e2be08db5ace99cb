"""The ``moend`` torch.compile backend.

Takes a dynamo FX graph of a prepared model and its plan; runs the FX passes of ``moend_fx.passes`` in their one
order (find attention nodes, validate against the plan, fuse dequantize + attention into one kernel op per
layer, clean up) under :class:`~moend_fx.compile.settings.BackendSettings`, then hands the graph to the inner
compiler (inductor, or aot_eager for tests)."""
