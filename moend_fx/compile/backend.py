"""The ``moend`` torch.compile backend: run the FX passes, then hand the graph to an inner compiler.

    model.compile(backend="moend", options={"plan": plan})   # then model.generate(...)
    torch.compile(fn, backend="moend", options={"inner": "aot_eager"})

The name is registered twice, so either way of reaching it works:

* at import of this module, with ``torch._dynamo.register_backend(name="moend")``;
* through the ``torch_dynamo_backends`` entry point in pyproject.toml
  (``moend = "moend_fx.compile.backend:moend_backend"``): ``torch.compile(..., backend="moend")`` finds it without
  ``import moend_fx`` first (dynamo imports this module, then registers the function itself).

Options: see :class:`moend_fx.compile.settings.BackendSettings`. Pitfall: ``torch.compile(model).generate(...)``
compiles nothing, since ``generate`` calls the original ``forward``; use ``model.compile(...)`` (docs/compile.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import EntryPoint
from typing import Any

import torch
import torch.fx as fx

from moend_fx.common.options import InnerCompiler
from moend_fx.compile.settings import BackendSettings, resolve_inner

BACKEND_NAME = "moend"


def graph_device_type(example_inputs: Sequence[Any]) -> str:
    """The device type a graph runs on: "cuda" if any example input tensor is on CUDA, else the first tensor's
    device type ("cpu" for a graph without tensor inputs)."""
    types = [x.device.type for x in example_inputs if isinstance(x, torch.Tensor)]
    return "cuda" if "cuda" in types else (types[0] if types else "cpu")


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], settings: BackendSettings) -> Callable:
    """Compile the rewritten graph with ``settings.inner`` (``auto``: resolved for the graph's device)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = resolve_inner(settings.inner, graph_device_type(example_inputs), settings.mode)
    if inner == InnerCompiler.EAGER:
        return gm.forward
    if inner == InnerCompiler.AOT_EAGER:
        return lookup_backend("aot_eager")(gm, list(example_inputs))
    from torch._inductor.compile_fx import compile_fx

    patches = dict(torch._inductor.list_mode_options(settings.mode)) if settings.mode is not None else {}
    # Quantization rounds scales and zeros to fp16 before computing codes; by default inductor may skip that
    # round trip, so a group flushed inside a compiled graph would get other codes than eager (measured here).
    patches["emulate_precision_casts"] = True
    return compile_fx(gm, list(example_inputs), config_patches=patches)


def moend_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendSettings | Mapping[str, Any] | None = None,
    mode: str | None = None, **kwargs: Any,
) -> Callable:
    """A dynamo backend: ``gm`` is the captured FX graph, ``example_inputs`` its inputs.

    ``options`` comes from ``torch.compile(..., options={...})``, ``mode`` from ``torch.compile(mode=...)``;
    further keyword arguments (``functools.partial(moend_backend, plan=plan)``) override ``options``.
    Raises :class:`moend_fx.common.errors.MoendError` for an unknown option or a bad value.
    """
    import moend_fx.passes as passes

    settings = BackendSettings.from_options(options, **({"mode": mode} if mode else {}), **kwargs)
    gm = passes.run_passes(gm, settings)
    return compile_inner(gm, example_inputs, settings)


def _register() -> None:
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    # Loaded through the entry point: dynamo's lookup_backend registers this function right after the
    # import and asserts the name is new, so registering here would break that path.
    if isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        return
    torch._dynamo.register_backend(moend_backend, name=BACKEND_NAME)


_register()
