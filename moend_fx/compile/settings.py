"""Settings of the ``moend`` torch.compile backend: one frozen dataclass, checked on construction.

Given as ``torch.compile(fn, backend="moend", options={...})`` (or ``model.compile(backend="moend",
options={...})``); every key is a field of :class:`BackendSettings`.

Where the plan comes from (``plan`` option), in this order:

* a :class:`~moend_fx.plan.routing.RoutingPlan`, or a path to a plan JSON file;
* an object that carries one: a prepared model (attribute ``moend_plan``), a ``MoENDCache`` (attribute
  ``plan``), or anything else with one of those attributes;
* nothing (``None``): the passes need no plan to fuse (each layer's bit widths and group size are read from
  its ``moend.dequantize`` nodes); only the ``validate_plan`` check is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from moend_fx.common.checks import check_choice
from moend_fx.common.errors import MoendError
from moend_fx.common.options import InnerCompiler, Kernel
from moend_fx.plan.routing import RoutingPlan


def resolve_plan(obj: Any) -> RoutingPlan | None:
    """The :class:`RoutingPlan` named by ``obj`` (see the module docstring), or None for None."""
    if obj is None or isinstance(obj, RoutingPlan):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return RoutingPlan.load(Path(obj))
    for attr in ("moend_plan", "plan"):
        found = getattr(obj, attr, None)
        if isinstance(found, RoutingPlan):
            return found
    raise MoendError(
        f"plan={type(obj).__name__} object is not a plan; allowed: a RoutingPlan, a path to a plan JSON file, "
        "a model prepared with moend_fx.prepare (attribute moend_plan), a MoENDCache (attribute plan), or None"
    )


# What ``inner="auto"`` hands a graph to, by the device type of its tensors (docs/compile.md, "Which inner
# compiler, and when compiling pays back"). CPU: aot_eager. Measured on SmolLM2-135M's decode graph (14x plan,
# 2k tokens, 2 idle cores): its first token comes 76 s sooner than inductor's on a cold cache (35 s vs 112 s of
# compile), and inductor's faster steps (38 vs 55 ms) win that back only after about 4,600 tokens at batch 1.
# Every other device: inductor, whose Triton code (and CUDA graphs, ``mode="reduce-overhead"``) a GPU step needs.
AUTO_INNER: Mapping[str, InnerCompiler] = {"cpu": InnerCompiler.AOT_EAGER}
AUTO_INNER_OTHER = InnerCompiler.INDUCTOR


def resolve_inner(inner: InnerCompiler | str, device_type: str, mode: str | None = None) -> InnerCompiler:
    """The inner compiler that runs a graph whose tensors live on ``device_type`` ("cpu", "cuda", ...):
    ``inner`` itself unless it is ``auto``; for ``auto``, inductor when an inductor ``mode`` is asked for (only
    inductor reads it), else :data:`AUTO_INNER` for the device (inductor for a device it does not name)."""
    inner = check_choice("inner", inner, InnerCompiler, error=MoendError)
    if inner != InnerCompiler.AUTO:
        return inner
    if mode is not None:
        return InnerCompiler.INDUCTOR
    return AUTO_INNER.get(device_type, AUTO_INNER_OTHER)


@dataclass(frozen=True)
class BackendSettings:
    """What the ``moend`` backend does with one FX graph.

    plan: the routing plan to check the graph against (None: skip the check). Normalised by
        :func:`resolve_plan`, so a prepared model, a cache or a JSON path are accepted too.
    inner: the compiler the rewritten graph is handed to: ``auto`` (default: per device, :func:`resolve_inner`),
        ``inductor`` (code generation: C++ on CPU, Triton on CUDA), ``aot_eager`` (AOTAutograd's aten graph, run
        op by op; no code generation) or ``eager`` (run the FX graph as is).
    kernel: which implementation the fused attention op uses: ``auto`` (CPU kernel on CPU, Triton on CUDA),
        ``triton``, ``cpu`` or ``reference`` (plain torch ops; always available).
    debug_dir: if set, each graph is written there as text before and after the passes.
    require_all_layers: the plan must cover exactly the layers found in one graph. Set False when the model is
        compiled without ``fullgraph=True`` and a graph break splits the decoder across graphs.
    fuse: run the fusion pass (False: find + validate only, the graph keeps dequantize + SDPA).
    mode: inductor's ``mode`` (``torch.compile(mode=...)`` passes it here; with ``inner="auto"`` it picks
        inductor); ignored by other inner compilers.
    """

    plan: RoutingPlan | None = None
    inner: InnerCompiler = InnerCompiler.AUTO
    kernel: Kernel = Kernel.AUTO
    debug_dir: str | None = None
    require_all_layers: bool = True
    fuse: bool = True
    mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", resolve_plan(self.plan))
        # Plain strings are accepted and stored as the enum member (which still compares equal to the string).
        object.__setattr__(self, "inner", check_choice("inner", self.inner, InnerCompiler, error=MoendError))
        object.__setattr__(self, "kernel", check_choice("kernel", self.kernel, Kernel, error=MoendError))
        if self.debug_dir is not None:
            if not isinstance(self.debug_dir, (str, os.PathLike)):
                raise MoendError(f"debug_dir={self.debug_dir!r} is invalid; allowed: a directory path or None")
            object.__setattr__(self, "debug_dir", os.fspath(self.debug_dir))
        for name in ("require_all_layers", "fuse"):
            if not isinstance(getattr(self, name), bool):
                raise MoendError(f"{name}={getattr(self, name)!r} is invalid; allowed: True or False")
        if self.mode is not None and not isinstance(self.mode, str):
            raise MoendError(f"mode={self.mode!r} is invalid; allowed: an inductor mode name or None")

    @classmethod
    def from_options(cls, options: BackendSettings | Mapping[str, Any] | None = None, **extra: Any) -> BackendSettings:
        """Build settings from ``options`` (a mapping or settings) plus keyword overrides; unknown keys raise."""
        if isinstance(options, BackendSettings):
            base = {f.name: getattr(options, f.name) for f in fields(cls)}
        elif options is None:
            base = {}
        elif isinstance(options, Mapping):
            base = dict(options)
        else:
            raise MoendError(f"options={type(options).__name__} is invalid; allowed: a dict, BackendSettings or None")
        base.update({k: v for k, v in extra.items() if v is not None or k not in base})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(base) - set(allowed))
        if unknown:
            raise MoendError(f"unknown moend backend option(s) {unknown}; allowed: {allowed}")
        return cls(**base)
