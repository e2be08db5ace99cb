"""moend_fx: MoE-nD per-layer KV-cache compression for PyTorch / Hugging Face models."""

from moend_fx.plan import Grid, LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.prepare import prepare as prepare

__version__ = "0.1.0"

__all__ = ["Grid", "LayerConfig", "ModelFingerprint", "RoutingPlan", "__version__"]
