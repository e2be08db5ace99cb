"""FX graph passes of the ``moend`` backend, importable as ``moend_fx.passes``."""
