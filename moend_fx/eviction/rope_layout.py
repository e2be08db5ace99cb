"""Where a model keeps its rotary embedding and which channels it rotates together (read by ``rope_from_model``).

Families differ in three ways the trig scorer must follow (docs/models.md):

* **where**: ``model.model.rotary_emb`` (Llama and most), ``model.gpt_neox.rotary_emb`` (GPT-NeoX), or any other
  submodule holding an ``inv_freq`` buffer: :func:`find_rotary` looks for it by that buffer, not by name;
* **how much**: partial rotary embeddings (Phi-2, StableLM, GPT-NeoX, ``partial_rotary_factor``) rotate only the
  first ``rotary_dim = 2 * len(inv_freq)`` channels of each head and pass the others through;
* **which pairs**: ``rotate_half`` (Llama: channel ``i`` with ``i + rotary_dim / 2``) or ``interleaved`` (Cohere:
  ``2i`` with ``2i + 1``).

:func:`pair_index` maps any of them onto one *canonical* order, ``[re_0 .. re_{F-1}, im_0 .. im_{F-1}]`` over the
whole head (``F = head_dim / 2`` pairs): the rotated pairs first, at their frequencies, then the passed-through
channels paired as frequency-0 pairs (a rotation by 0 leaves them alone). In that order every formula written for
full ``rotate_half`` RoPE holds unchanged, and a dot product is the same in either order.
"""

from __future__ import annotations

from typing import Any

import torch

from moend_fx.common.errors import MoendError
from moend_fx.plan.families import family_of

ROPE_LAYOUTS: tuple[str, ...] = ("rotate_half", "interleaved")
"""The pairings of rotated channels moend_fx reads; a family with another is refused (moend_fx.plan.families)."""


def pair_index(rotary_pairs: int, pass_dims: int, layout: str) -> tuple[int, ...]:
    """The model channel at each canonical position: ``canonical = x[..., index]`` ([head_dim] ints).

    rotary_pairs: rotated pairs (``rotary_dim / 2``); pass_dims: channels after them left alone (even)."""
    if layout not in ROPE_LAYOUTS:
        raise MoendError(f"RoPE layout {layout!r} is not supported; allowed: {list(ROPE_LAYOUTS)}")
    if pass_dims < 0 or pass_dims % 2:
        raise MoendError(f"RoPE pass-through channels {pass_dims}: must be an even number >= 0")
    r, half_pass = 2 * rotary_pairs, pass_dims // 2
    if layout == "rotate_half":
        re, im = list(range(rotary_pairs)), list(range(rotary_pairs, r))
    else:
        re, im = list(range(0, r, 2)), list(range(1, r, 2))
    re += list(range(r, r + half_pass))
    im += list(range(r + half_pass, r + pass_dims))
    return tuple(re + im)


def find_rotary(model: Any) -> tuple[str, Any] | None:
    """``(path, module)`` of the model's rotary embedding: ``model.model.rotary_emb`` or ``model.rotary_emb`` when
    present, else the first submodule (in ``named_modules`` order) with an ``inv_freq`` buffer, or a per-layer-type
    one (``full_attention_inv_freq``: Gemma 2 / 3); None if there is none."""
    for path in ("model.rotary_emb", "rotary_emb"):
        owner = model
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if owner is not None:
            return path, owner
    for name, module in model.named_modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) or hasattr(module, "full_attention_inv_freq"):
            return name, module
    return None


def head_dim_of(config: Any) -> int:
    """A text config's attention head size: ``head_dim`` when it sets one, else ``hidden_size / heads``."""
    heads = int(config.num_attention_heads)
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def rope_layout_of(model: Any) -> str:
    """The pairing of the model's rotated channels: ``interleaved`` for the families that use it (the family
    table, moend_fx.plan.families), else ``rotate_half``."""
    row = family_of(model)
    return row.rope_layout if row is not None else "rotate_half"
