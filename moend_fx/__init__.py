"""moend_fx: MoE-nD per-layer KV-cache compression for PyTorch / Hugging Face models."""

from typing import Any

from moend_fx.plan import Grid, LayerConfig, ModelFingerprint, RoutingPlan

__version__ = "0.1.0"

__all__ = ["Grid", "LayerConfig", "ModelFingerprint", "RoutingPlan", "prepare", "unprepare", "__version__"]


def __getattr__(name: str) -> Any:
    # prepare pulls in transformers (~2 s): import it on first use so `moend solve` and solver workers start fast.
    if name in ("prepare", "unprepare"):
        from moend_fx import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'moend_fx' has no attribute {name!r}")
