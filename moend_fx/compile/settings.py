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


@dataclass(frozen=True)
class BackendSettings:
    """What the ``moend`` backend does with one FX graph.

    plan: the routing plan to check the graph against (None: skip the check). Normalised by
        :func:`resolve_plan`, so a prepared model, a cache or a JSON path are accepted too.
    inner: the compiler the rewritten graph is handed to: ``inductor`` (default), ``aot_eager`` (tests: real
        autograd tracing, no code generation) or ``eager`` (run the FX graph as is).
    kernel: which implementation the fused attention op uses: ``auto`` (CPU kernel on CPU, Triton on CUDA),
        ``triton``, ``cpu`` or ``reference`` (plain torch ops; always available).
    debug_dir: if set, each graph is written there as text before and after the passes.
    require_all_layers: the plan must cover exactly the layers found in one graph. Set False when the model is
        compiled without ``fullgraph=True`` and a graph break splits the decoder across graphs.
    fuse: run the fusion pass (False: find + validate only, the graph keeps dequantize + SDPA).
    mode: inductor's ``mode`` (``torch.compile(mode=...)`` passes it here); ignored by other inner compilers.
    """

    plan: RoutingPlan | None = None
    inner: InnerCompiler = InnerCompiler.INDUCTOR
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
