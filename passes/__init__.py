"""FX graph passes of the ``moend`` backend, importable as ``moend_fx.passes``.

Every pass has the signature ``pass_(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule`` and lives in
its own file; its docstring says when it must not fire. :data:`PASSES` is the one place that fixes their order:

1. :func:`find_attention`: tag every attention node with its layer index (changes nothing).
2. :func:`validate_plan`: check the plan against the tagged nodes (changes nothing; needs a plan).
3. :func:`fuse_quantized_attention`: ``dequantize -> cat -> SDPA`` becomes one ``moend.packed_attention`` node.

:func:`run_passes` runs them, with :func:`cleanup` (dead code, lint, recompile) after each pass that edits the
graph, and logs / dumps the graph before and after (``passes.debug``). The other modules are no passes: ``common``
(op targets, metadata keys, shape helpers) and ``match_packed_attention`` (what pass 3 matches, read-only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.fx as fx

from .cleanup import cleanup
from .debug import dump_graph, log
from .find_attention import find_attention
from .fuse_quantized_attention import fuse_quantized_attention
from .validate_plan import validate_plan

if TYPE_CHECKING:
    from moend_fx.compile.settings import BackendSettings

Pass = Callable[[fx.GraphModule, "BackendSettings | None"], fx.GraphModule]

PASSES: tuple[Pass, ...] = (
    find_attention,
    validate_plan,
    fuse_quantized_attention,
)
# Passes that only read the graph skip the clean-up (recompiling costs time on big graphs).
_READ_ONLY: frozenset[Pass] = frozenset({find_attention, validate_plan})


# Wall seconds each pass (with its clean-up) has taken in this process, summed over graphs: what the backend
# itself adds to a compile, read by the compile-time benchmark (``pass_seconds``).
_SECONDS: dict[str, float] = {}


def pass_seconds() -> dict[str, float]:
    """{pass name: seconds} spent in :func:`run_passes` in this process so far."""
    return dict(_SECONDS)


def run_passes(gm: fx.GraphModule, settings: BackendSettings | None,
               passes: tuple[Pass, ...] = PASSES) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``; returns the rewritten graph module."""
    debug_dir = getattr(settings, "debug_dir", None)
    dump_graph(gm, "before", debug_dir)
    for pass_ in passes:
        t0 = time.perf_counter()
        gm = pass_(gm, settings)
        if pass_ not in _READ_ONLY:
            gm = cleanup(gm)
        _SECONDS[pass_.__name__] = _SECONDS.get(pass_.__name__, 0.0) + time.perf_counter() - t0
        log.debug("moend: ran pass %s", pass_.__name__)
    dump_graph(gm, "after", debug_dir)
    return gm


__all__ = ["PASSES", "cleanup", "find_attention", "fuse_quantized_attention", "pass_seconds", "run_passes",
           "validate_plan"]
