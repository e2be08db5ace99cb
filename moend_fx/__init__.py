"""moend_fx: MoE-nD per-layer KV-cache compression for PyTorch / Hugging Face models.

The package is laid out by stage of the data flow (see docs/architecture.md)::

    calibration/  texts -> SensitivityTable S[layer, config]
    solvers/      table + budget -> RoutingPlan
    plan/         the plan, grid, fingerprint and the one memory model
    storage/      quantization, bit packing, one layer's packed K/V
    eviction/     RoPE helpers, scorers, token selection, the eviction policy
    cache/        the Hugging Face cache, its layer, prepare(), the HF attention function
    attention/    the reference attention (oracle) and the packed form the backend fuses
    compile/      the ``moend`` torch.compile backend (its FX passes live in ``moend_fx.passes``)
    kernels/      fused attention over packed K/V (C++ on CPU, Triton on GPU)
    models/       the embedded real models and tiny random-weight test models
    eval/, bench/, cli/

The names below are imported on first use, so ``import moend_fx`` stays cheap (no transformers import).
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "Grid": "moend_fx.plan.routing",
    "LayerConfig": "moend_fx.plan.routing",
    "ModelFingerprint": "moend_fx.plan.routing",
    "RoutingPlan": "moend_fx.plan.routing",
    "SensitivityTable": "moend_fx.calibration.sensitivity",
    "calibrate": "moend_fx.calibration.pipeline",
    "MoENDCache": "moend_fx.cache.moend_cache",
    "prepare": "moend_fx.cache.generation",
    "unprepare": "moend_fx.cache.generation",
    "get_solver": "moend_fx.solvers",
    "load_model": "moend_fx.models",
    "MoendError": "moend_fx.common.errors",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'moend_fx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
