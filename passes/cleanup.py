"""The one graph clean-up every pass ends with: dead code elimination, lint, recompile."""

from __future__ import annotations

import torch.fx as fx


def cleanup(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop nodes nobody uses (e.g. the dequantize/cat/mask nodes a fusion left behind), check the graph's
    invariants and regenerate ``gm.forward``. Ops with side effects survive ``eliminate_dead_code``."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
