"""Rolling a :class:`~moend_fx.cache.layer.MoENDLayer` back: ``crop`` after a speculative verify step.

transformers' assisted decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``) calls
``cache.activate_past_recording()`` once, then after every forward of the main model ``cache.crop(-m)``: drop the
m newest tokens (the rejected candidates). A compressed layer cannot take back a token once it is quantized into a
K group or has taken part in an eviction, so while the layer records its past nothing a forward adds is made
final before its crop:

* the forward's update is appended as usual (attention reads it; K groups it completes are quantized), and the
  layer keeps an :class:`OpenStep`: the counts it held before and its old residual window (at most a group of
  tokens), the step's new K/V (the forward's own tensors);
* its attention neither observes the queries nor evicts (kept in the step, for the replay);
* ``crop(-m)`` cuts the storage back to what it held before the first open step (:func:`cut`: slices of the
  packed blocks, the old residual window: bit for bit), then replays the kept tokens as one-by-one decode steps
  would feed them (append, observe the query, count the step, evict when due: :func:`replay_token`). The layer is
  then what plain decoding of the kept tokens leaves, given their K/V/queries from the verify forward. A staged
  prompt (assisted decoding's first forward is prompt plus candidates) stays dense until its crop, which
  compresses the kept tokens only, as a prefill of them would;
* in capacity mode the layer first makes room for the step's tokens (:meth:`Evictor.make_room`: an eviction of
  older tokens, never undone), so the byte cap holds while the step is open too.

``layer.record_past`` is how many forwards may stay open: True (one, transformers' assisted decoding, which crops
after every forward; a later forward without a crop, e.g. a second turn of plain decoding on the returned cache,
commits the open one first: plain decoding, replayed) or an int n (a drafter's n decode steps before its round's
crop). An update beyond that, after an open prompt, or that would not fit the byte cap beside the open steps,
commits them first (``crop(0)``). Beyond the open steps nothing can be cropped: a :class:`MoendError` says so.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moend_fx.cache.masks import held_attention
from moend_fx.common.errors import MoendError
from moend_fx.common.options import QuantMode
from moend_fx.storage.packed import Block, PackedKV, _row_major_empty, slot_positions

# A MoENDLayer (moend_fx.cache.layer), which imports this module: typed loosely here to keep the import one-way.
MoENDLayer = Any



@dataclass(frozen=True)
class Before:
    """What a layer held before a step: ``tokens`` in all, ``k_packed`` / ``v_packed`` of them in packed blocks,
    the residual windows k_res, v_res [B, H, R, D] (the tensors themselves) and the positions' dtype."""

    tokens: int
    k_packed: int
    v_packed: int
    k_res: torch.Tensor
    v_res: torch.Tensor
    positions: torch.dtype | None

    @classmethod
    def of(cls, packed: PackedKV) -> Before:
        v = packed.v_packed.shape[2] if isinstance(packed.v_packed, torch.Tensor) else packed.v_packed.num_tokens
        pos = None if packed.positions is None else packed.positions.dtype
        return cls(packed.num_tokens, packed.num_packed, v, packed.k_res, packed.v_res, pos)


@dataclass
class OpenStep:
    """One forward not yet cropped: it fed keys, values [B, Hkv, L, D] at logical slots ``start .. start + L - 1``;
    ``before`` is the storage before it (None: a staged prompt). Attention fills query [B, H, L, D], mask (the
    logical mask [B, 1, L, start + L] or None) and position_ids [B|1, L] or None."""

    start: int
    before: Before | None
    keys: torch.Tensor
    values: torch.Tensor
    query: torch.Tensor | None = field(default=None, repr=False)
    mask: torch.Tensor | None = field(default=None, repr=False)
    position_ids: torch.Tensor | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def attended(self, query: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
        self.query, self.mask, self.position_ids = query, mask, position_ids


def _head(block: Block, n: int, group_size: int) -> Block:
    """The first ``n`` tokens of a packed block (``n`` a multiple of the group size for a "channel" block)."""
    if isinstance(block, torch.Tensor):
        return block if block.shape[2] == n else _row_major_empty(block[:, :, :n].contiguous())
    if block.num_tokens == n:
        return block
    s = n // group_size if block.mode == QuantMode.CHANNEL else n
    return replace(block, codes=_row_major_empty(block.codes[:, :, :n].contiguous()),
                   scale=_row_major_empty(block.scale[:, :, :s].contiguous()),
                   zero=_row_major_empty(block.zero[:, :, :s].contiguous()))


def cut(packed: PackedKV, before: Before) -> PackedKV:
    """``packed`` (which only appended since ``before``: nothing evicted) back to what it held then, bit for bit."""
    pos = packed.positions
    if pos is not None:
        pos = pos[:, :, : before.tokens].to(before.positions or pos.dtype).contiguous()
    return replace(packed, k_packed=_head(packed.k_packed, before.k_packed, packed.group_size),
                   v_packed=_head(packed.v_packed, before.v_packed, packed.group_size),
                   k_res=before.k_res, v_res=before.v_res, positions=pos)


def open_step(layer: MoENDLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Before a recording ``layer`` takes keys, values [B, Hkv, L, D]: commit what is open if it is a prompt or
    the step would not fit beside it; for a packed layer make room for the step (capacity mode); open the step."""
    n_new = keys.shape[2]
    if layer.open and (layer.open[0].before is None or len(layer.open) >= int(layer.record_past)
                       or not _fits(layer, n_new)):
        commit(layer, open_tokens(layer))
    if layer.packed is None:  # a prompt: staged (dense) until its crop
        layer.open.append(OpenStep(layer.logical, None, keys, values))
        return
    if not layer.open:
        layer.packed = layer.evictor.make_room(layer.packed, layer.logical, n_new)
    layer.open.append(OpenStep(layer.logical, Before.of(layer.packed), keys, values))


def _fits(layer: MoENDLayer, n_new: int) -> bool:
    """Whether ``n_new`` more tokens fit a capacity-mode layer's cap beside what it holds (True in ratio mode)."""
    ev, packed = layer.evictor, layer.packed
    return not ev.policy.capped or ev.budget.steps_that_fit(
        packed.num_tokens, layer.logical, ev.queries_seen, batch=layer.batch_size, dtype=packed.dtype,
        evicting=ev.evicting, limit=n_new) >= n_new


def open_tokens(layer: MoENDLayer) -> int:
    """Tokens of the layer's open steps."""
    return sum(step.length for step in layer.open)


def crop(layer: MoENDLayer, tokens_to_remove: int) -> None:
    """HF's ``crop``: drop the ``-tokens_to_remove`` newest tokens (0: commit what is open); see the module doc."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
        raise MoendError(f"crop({tokens_to_remove!r}) is invalid; allowed: an int <= 0, minus the number of newest "
                         "tokens to drop (transformers' convention)")
    drop, held = -tokens_to_remove, open_tokens(layer)
    if drop > held:
        raise MoendError(
            f"layer {layer.layer_idx}: cannot crop {drop} tokens; only the {held} fed since the last crop while "
            "recording can be taken back (older ones are quantized or evicted). Call "
            "cache.activate_past_recording() before the forward you may crop (assisted generation does)")
    if layer.open:
        commit(layer, held - drop)


def commit(layer: MoENDLayer, keep: int) -> None:
    """Make the first ``keep`` open tokens final and drop the rest (see the module docstring)."""
    steps, layer.open = layer.open, []
    if any(step.query is None for step in steps):
        raise MoendError(f"layer {layer.layer_idx}: crop between an update and its attention")
    if steps[0].before is None:
        _compress_prompt(layer, steps[0], min(keep, steps[0].length))
        keep -= min(keep, steps[0].length)
        steps = steps[1:]
    elif layer.packed is not None:
        layer.packed, layer.logical = cut(layer.packed, steps[0].before), steps[0].start
    for step in steps:
        for i in range(min(keep, step.length)):
            replay_token(layer, step, i)
        keep -= min(keep, step.length)


def _compress_prompt(layer: MoENDLayer, step: OpenStep, n: int) -> None:
    """The staged prompt's first ``n`` tokens, evicted and compressed as a prefill of them would be."""
    k, v = layer._staged
    if n == 0:
        layer.reset()
        return
    layer._staged, layer.logical = None, n
    mask = None if step.mask is None else step.mask[:, :, :n, :n]
    pid = None if step.position_ids is None else step.position_ids[..., :n]
    layer.evictor.observe(step.query[:, :, :n], n, pid)
    layer._compress_prompt(k[:, :, :n], v[:, :, :n], mask)


def attend_open(layer: MoENDLayer, query: torch.Tensor, lmask: torch.Tensor | None, scale: float | None,
                position_ids: torch.Tensor | None) -> torch.Tensor:
    """Attention of the open step's query [B, H, L, D] under the logical mask lmask [B, 1, L, S] (or None), each
    row over what one-by-one decoding holds at its token: a copy of the layer cut back to before the first open
    step replays the earlier open tokens, then, per row, appends its token, attends that row alone (the decode
    step's own shapes) and observes / evicts as decoding would after it. So a K group quantized or an eviction
    made inside a verify step is seen by the rows after it only, as in plain decoding; the layer itself stays as
    it is until the crop. A single open token (and a drafter's one-token steps after the first) attends the layer
    as it is: for the first, that is what decoding holds; after it, a drafter only proposes. Returns [B, H, L, D]."""
    step = layer.open[-1]
    step.attended(query, lmask, position_ids)
    if step.length == 1:
        return held_attention(layer.attention_fn, query, layer.packed, lmask, scale)
    shadow = _shadow(layer)
    for earlier in layer.open[:-1]:
        for i in range(earlier.length):
            replay_token(shadow, earlier, i)
    rows = []
    for i in range(step.length):
        _append_token(shadow, step, i)
        mask = None if lmask is None else lmask[:, :, i : i + 1, : step.start + i + 1]
        rows.append(held_attention(layer.attention_fn, query[:, :, i : i + 1], shadow.packed, mask, scale))
        _after_token(shadow, step, i)
    return torch.cat(rows, dim=2)


def _shadow(layer: MoENDLayer) -> MoENDLayer:
    """A copy of ``layer`` (its eviction state included) holding what it held before its first open step."""
    steps, packed = layer.open, layer.packed
    layer.open, layer.packed = [], None  # not copied: the steps are read from the layer, the storage is cut
    try:
        shadow = copy.deepcopy(layer)
    finally:
        layer.open, layer.packed = steps, packed
    shadow.packed, shadow.logical = cut(packed, steps[0].before), steps[0].start
    return shadow


def replay_token(layer: MoENDLayer, step: OpenStep, i: int) -> None:
    """Feed token ``i`` of ``step`` as a decode step of its own: append, observe its query, count, evict if due."""
    _append_token(layer, step, i)
    _after_token(layer, step, i)


def _append_token(layer: MoENDLayer, step: OpenStep, i: int) -> None:
    s = step.start + i
    k, v = step.keys[:, :, i : i + 1], step.values[:, :, i : i + 1]
    pos = None if layer.packed.positions is None else slot_positions(s, s + 1, k)
    layer.packed = layer.packed.append(k, v, pos, keep_full=True)
    layer.logical = s + 1


def _after_token(layer: MoENDLayer, step: OpenStep, i: int) -> None:
    """What a decode step does after its attention: observe the query, count the step, evict if due."""
    s, ev = step.start + i, layer.evictor
    mask = None if step.mask is None else step.mask[:, :, i : i + 1, : s + 1]
    pid = None if step.position_ids is None else step.position_ids[..., i : i + 1]
    ev.observe(step.query[:, :, i : i + 1], s + 1, pid)
    layer.packed = ev.decode_step(layer.packed, mask, s + 1)
    replayed = getattr(layer, "replayed", None)  # a sliding layer's oldest token leaves (moend_fx.cache.sliding)
    if replayed is not None:
        replayed()


def shadow_candidates(model: Any) -> None:
    """Shadow ``model._get_candidate_generator`` (on the instance; ``moend_fx.prepare`` does it): for a MoENDCache,
    the candidate generator proposes nothing on its first call, so assisted decoding's first forward is the prompt
    alone. Why: that forward's candidates would attend to the whole dense prompt (it is compressed only at the
    crop), where plain decoding's next tokens attend to the compressed prompt; the tokens could then differ from
    plain greedy decoding's by more than rounding. It costs one verify step without candidates."""
    original = model._get_candidate_generator

    def _get_candidate_generator(self: Any, *args: Any, **kwargs: Any) -> Any:
        generator = original(*args, **kwargs)
        cache = (kwargs.get("model_kwargs") or {}).get("cache")
        if any(isinstance(getattr(layer, "open", None), list) for layer in getattr(cache, "layers", ())):
            generator.get_candidates = _none_first(generator.get_candidates)
        return generator

    model._get_candidate_generator = types.MethodType(_get_candidate_generator, model)


def _none_first(get_candidates: Callable[..., Any]) -> Callable[..., Any]:
    """``get_candidates`` whose first call's candidates are dropped (input_ids [B, T] itself, no logits). The
    generator still runs (a drafter's state, e.g. its attention mask, follows the calls it saw)."""
    calls = []

    def first_none(input_ids: torch.Tensor, **kwargs: Any) -> Any:
        out = get_candidates(input_ids, **kwargs)
        calls.append(1)
        return (input_ids, None) if len(calls) == 1 else out

    return first_none


def eager_if_assisted(model: Any, kwargs: dict[str, Any]) -> Any:
    """A context for ``model.generate(**kwargs)``: ``force_eager`` when the call decodes with candidates (an
    ``assistant_model``, ``prompt_lookup_num_tokens`` or a ``candidate_generator`` in the call or the generation
    config), else a no-op. Why: on a compiled model each verify step's candidate count would be its own graph, and
    the open/crop bookkeeping is eager code; the compiled graph serves plain one-token decode steps."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    keys = ("assistant_model", "prompt_lookup_num_tokens")
    assisted = any(kwargs.get(k) is not None for k in keys) or any(
        getattr(config, k, None) is not None for k in ("prompt_lookup_num_tokens", "assistant_early_exit"))
    return torch.compiler.set_stance("force_eager") if assisted else contextlib.nullcontext()
