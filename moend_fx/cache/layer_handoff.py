"""How the "moend" attention finds its cache layer in families whose attention module keeps its keyword arguments
from ``cache.update`` (GPT-NeoX calls ``layer_past.update(k, v, layer_idx)`` with none).

Everywhere else :meth:`MoENDLayer.update` puts itself in the kwargs dict the module then hands to the attention
function. For a family whose :data:`~moend_fx.plan.families.FAMILIES` row says ``update_kwargs=False``,
``prepare`` adds a forward pre-hook to each attention module that puts ``moend_layer`` (the MoENDCache's layer
``module.layer_idx``) in the module's own keyword arguments, which it passes on to the attention function. The hook
is plain Python on the module call, so dynamo traces through it like the rest of the forward.
"""

from __future__ import annotations

from typing import Any

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.plan.families import family_of

_HANDLES = "_moend_handoff_hooks"
_CACHE_KWARGS = ("layer_past", "past_key_values", "cache")  # what families call the cache they pass to attention


def _hand_over(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if isinstance(cache, MoENDCache):
        kwargs["moend_layer"] = cache.layers[module.layer_idx]
    return args, kwargs


def install_handoff(model: Any) -> int:
    """Hook the attention modules of ``model`` if its family needs it; returns how many were hooked."""
    row = family_of(model)
    if row is None or row.update_kwargs or getattr(model, _HANDLES, None):
        return 0
    handles = [module.register_forward_pre_hook(_hand_over, with_kwargs=True)
               for name, module in model.named_modules()
               if isinstance(getattr(module, "layer_idx", None), int) and name.rsplit(".", 1)[-1].endswith(
                   ("attention", "attn"))]
    setattr(model, _HANDLES, handles)
    return len(handles)


def remove_handoff(model: Any) -> None:
    """Undo :func:`install_handoff`."""
    for handle in getattr(model, _HANDLES, None) or ():
        handle.remove()
    model.__dict__.pop(_HANDLES, None)
