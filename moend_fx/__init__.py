"""moend_fx: MoE-nD per-layer KV-cache compression for PyTorch / Hugging Face models."""

from typing import Any

from moend_fx.plan import Grid, LayerConfig, ModelFingerprint, RoutingPlan

__version__ = "0.1.0"

__all__ = ["Grid", "LayerConfig", "ModelFingerprint", "RoutingPlan", "prepare", "__version__"]


def __getattr__(name: str) -> Any:
    # prepare pulls in transformers (~2 s): import it on first use so `moend solve` and solver workers start fast.
    if name == "prepare":
        from moend_fx.prepare import prepare

        return prepare
    raise AttributeError(f"module 'moend_fx' has no attribute {name!r}")
