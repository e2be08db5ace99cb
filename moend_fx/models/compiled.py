"""Undoing ``nn.Module.compile``: torch has no public way back to eager calls.

``model.compile(...)`` stores ``torch.compile(model._call_impl, ...)`` in the private attribute
``model._compiled_call_impl``, and ``nn.Module.__call__`` runs it whenever it is not None. Clearing it is the
only way to get the module's eager ``__call__`` back; this module is the one place that touches it (checked
against torch 2.13.0: ``Module.compile`` and ``Module._wrapped_call_impl``). Dynamo's caches are untouched:
call ``torch._dynamo.reset()`` as well to drop the compiled graphs.
"""

from __future__ import annotations

import torch

_COMPILED_CALL = "_compiled_call_impl"  # private in torch.nn.Module (torch 2.13.0)


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model.compile(...)`` is in effect (its ``__call__`` runs the compiled function)."""
    return getattr(model, _COMPILED_CALL, None) is not None


def uncompile(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``model.compile(...)``: later calls run eagerly. A no-op on a module that is not compiled.
    Returns ``model``."""
    if is_compiled(model):
        setattr(model, _COMPILED_CALL, None)
    return model
