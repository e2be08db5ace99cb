"""The one memory model: exactly the bytes a compressed layer stores (see ``docs/cache-format.md``).

A layer that keeps ``n`` tokens stores, per batch row and KV head:

* K: ``P = (n // G) * G`` tokens in packed groups (when K or V is quantized) and ``R = n - P`` tokens in a
  residual window kept as is. A lossless layer (16/16 bits) stores all ``n`` as is.
* packed K: ``P * D * k_bits / 8`` code bytes + fp16 scale and zero per (group of G tokens, channel);
  16-bit K is stored as is (``P * D * 2``).
* V: a quantized V is packed as each token arrives (its groups are per token, so it needs no residual window):
  ``n * D * v_bits / 8`` code bytes + fp16 scale and zero per (token, group of G channels). A 16-bit V is stored
  as is, split like K (P packed, R residual: the same bytes either way).
* "as is" means in the 16-bit storage type of the model's dtype (``moend_fx.common.dtypes.storage_dtype``: fp16,
  or bf16 for a bf16 model): 2 bytes per element whatever the model computes in.
* positions: one integer per kept token, only when the layer evicts (keep_ratio < 1), in the narrowest type that
  holds the layer's logical slots (``moend_fx.common.dtypes.position_dtype``: int16 up to 32768 tokens, else int32).

Solvers, reports, budgets and the cache's measured ``nbytes()`` all use these functions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from moend_fx.common.defaults import GROUP_SIZE, QUERY_WINDOW, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.dtypes import position_dtype, storage_dtype
from moend_fx.common.errors import BudgetError
from moend_fx.common.options import ScorerName
from moend_fx.plan.config import LayerConfig
from moend_fx.plan.fingerprint import ModelFingerprint
from moend_fx.plan.scorer_state import scorer_state_bytes

SCALE_BYTES = 2  # fp16 scale and fp16 zero per quantization group
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# The floor of a plan with default sinks and recent window (4 + 32): what plan-level byte predictions assume
# when they are not given the plan itself (solver byte matrices).
DEFAULT_KEEP_FLOOR: int = SINK_TOKENS + RECENT_TOKENS


class PlanShape(Protocol):
    """What the memory model reads of a plan (a :class:`~moend_fx.plan.routing.RoutingPlan` has it all).

    A protocol rather than the class itself: the routing plan prices its own bytes here, so this module must
    not import it back."""

    layers: Sequence[LayerConfig]
    fingerprint: ModelFingerprint
    context_length: int
    group_size: int
    sink_tokens: int
    recent_tokens: int
    scorer: str


def keep_count(tokens: int, keep_ratio: float, floor: int = 0) -> int:
    """Tokens a layer keeps out of ``tokens``: ``max(ceil(keep_ratio * T), min(T, floor))``, clamped to
    ``[min(1, T), T]``.

    The product is rounded to 9 decimals first so that e.g. ``0.1 * 30`` keeps 3 tokens, not 4.
    ``floor``: the fewest tokens an evicting layer keeps whatever its ratio (MoENDCache and the plan-level byte
    predictions pass ``keep_floor(plan)`` = sinks + recent window, 36 by default), so a plan solved for 2048
    tokens applied to a short prompt still keeps its sinks and recent window. It does not move results at
    the plan's own length when ``keep_ratio * T >= floor`` (2048 x 0.1 = 205 > 36). A layer with keep 1.0
    keeps ``T`` either way.
    """
    if tokens <= 0:
        return 0
    n = math.ceil(round(keep_ratio * tokens, 9))
    n = max(n, min(tokens, floor))
    return max(1, min(tokens, n))


def keep_floor(plan: PlanShape) -> int:
    """The fewest tokens an evicting layer of ``plan`` keeps: its sinks plus its recent window."""
    return plan.sink_tokens + plan.recent_tokens


def split_packed(n: int, config: LayerConfig, group_size: int) -> tuple[int, int]:
    """(packed tokens P, residual tokens R) for a layer holding ``n`` tokens."""
    if not config.quantized:
        return 0, n
    p = (n // group_size) * group_size
    return p, n - p


def dtype_bytes(dtype: Any) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise BudgetError(f"dtype {name!r} is not supported; allowed: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def layer_bytes_breakdown(
    config: LayerConfig,
    tokens: int,
    *,
    kv_heads: int,
    head_dim: int,
    batch: int = 1,
    group_size: int = GROUP_SIZE,
    dtype: Any = "float32",
    kept: int | None = None,
    slots: int | None = None,
    floor: int = 0,
    positions: bool | None = None,
) -> dict[str, int]:
    """Bytes by part for one layer after it has seen ``tokens`` tokens (or holds exactly ``kept``).

    dtype: the model's dtype (a torch dtype or its name); raw K/V (16-bit sides, the residual window) are stored
    in its :func:`~moend_fx.common.dtypes.storage_dtype`, 2 bytes an element whatever it is.
    slots: the logical slots the layer has handed out (its logical length), which picks the positions' integer
    type; default ``max(tokens, n)``, what a MoENDCache layer has after a prompt of ``tokens`` tokens. A caller
    that gives ``kept`` for a layer past 32768 tokens passes its logical length here.
    floor: the kept-token floor of :func:`keep_count` (``keep_floor(plan)`` for a MoENDCache layer).
    positions: whether the layer stores positions; default ``config.evicts`` (True also for a keep-1.0 layer that
    has started evicting because it outgrew its byte budget: ``budget_mode="capacity"``)."""
    n = keep_count(tokens, config.keep_ratio, floor) if kept is None else kept
    p, r = split_packed(n, config, group_size)
    d = head_dim
    rows = batch * kv_heads
    raw = storage_dtype(dtype).itemsize
    pv, rv = (n, 0) if config.v_bits < 16 else (p, r)  # a quantized V is packed on arrival
    k_codes = p * d * raw if config.k_bits == 16 else p * d * config.k_bits // 8
    v_codes = pv * d * raw if config.v_bits == 16 else pv * d * config.v_bits // 8
    k_scales = 0 if config.k_bits == 16 else (p // group_size) * d * 2 * SCALE_BYTES
    v_groups = math.ceil(d / min(group_size, d))
    v_scales = 0 if config.v_bits == 16 else pv * v_groups * 2 * SCALE_BYTES
    position_bytes = position_dtype(max(tokens, n) if slots is None else slots).itemsize
    return {
        "k_codes": rows * k_codes,
        "v_codes": rows * v_codes,
        "scales": rows * (k_scales + v_scales),
        "residual": rows * (r + rv) * d * raw,
        "positions": rows * n * position_bytes if (config.evicts if positions is None else positions) else 0,
    }


def layer_bytes(config: LayerConfig, tokens: int, **kw: Any) -> int:
    """Total bytes of one compressed layer; keyword arguments as :func:`layer_bytes_breakdown`."""
    return sum(layer_bytes_breakdown(config, tokens, **kw).values())


PARTS: tuple[str, ...] = ("k_codes", "v_codes", "scales", "residual", "positions", "scorer_state")
"""The parts of :func:`plan_layer_parts`, in the order reports print them."""


def plan_layer_parts(
    config: LayerConfig, tokens: int, fp: ModelFingerprint, *, group_size: int = GROUP_SIZE, batch: int = 1,
    floor: int = DEFAULT_KEEP_FLOOR, scorer: str | None = ScorerName.TRIG, calibrated: bool = True,
    window: int = QUERY_WINDOW, layer: int | None = None,
) -> dict[str, int]:
    """Every byte a MoENDCache layer with ``config`` holds after a prompt of ``tokens`` tokens, by part
    (:data:`PARTS`): its storage (:func:`layer_bytes_breakdown`) and its eviction state ``scorer_state``
    (:func:`~moend_fx.plan.scorer_state.scorer_state_bytes`: ``scorer``, whether the layer has calibrated query
    statistics, the query ``window``; 0 for a layer that keeps every token). ``floor``: the plan's kept-token
    floor (:func:`keep_floor`; default: that of a plan with default sinks and window).
    layer: the layer's index in ``fp``; a sliding-window layer (``fp.is_sliding(layer)``) holds
    :func:`sliding_kept` tokens, with their positions and no eviction state (its oldest token leaves as each new
    one arrives: ``moend_fx.cache.sliding``). None: a full-attention layer."""
    if layer is not None and fp.is_sliding(layer):
        parts = layer_bytes_breakdown(config, tokens, kv_heads=fp.num_kv_heads, head_dim=fp.head_dim, batch=batch,
                                      group_size=group_size, dtype=fp.dtype, slots=max(tokens, 1), positions=True,
                                      kept=sliding_kept(fp.layer_tokens(layer, tokens), config.keep_ratio))
        return {**parts, "scorer_state": 0}
    parts = layer_bytes_breakdown(config, tokens, kv_heads=fp.num_kv_heads, head_dim=fp.head_dim, batch=batch,
                                  group_size=group_size, dtype=fp.dtype, floor=floor)
    parts["scorer_state"] = scorer_state_bytes(config, tokens, scorer=scorer, num_heads=fp.num_heads,
                                               head_dim=fp.head_dim, batch=batch, window=window,
                                               calibrated=calibrated)
    return parts


def sliding_kept(window_tokens: int, keep_ratio: float) -> int:
    """Tokens a sliding-window layer keeps of the ``window_tokens`` its window holds (``min(T, window - 1)``): a
    keep ratio below 1 narrows its window to its most recent ``ceil(keep_ratio * window_tokens)`` tokens."""
    return keep_count(window_tokens, keep_ratio)


def plan_layer_bytes(config: LayerConfig, tokens: int, fp: ModelFingerprint, **kw: Any) -> int:
    """The sum of :func:`plan_layer_parts` (same arguments): every byte of one MoENDCache layer."""
    return sum(plan_layer_parts(config, tokens, fp, **kw).values())


def plan_parts(plan: PlanShape, tokens: int | None = None, batch: int = 1,
               calibrated: bool = True) -> list[dict[str, int]]:
    """:func:`plan_layer_parts` of each layer of ``plan`` at ``tokens`` (default: the plan's context length), as
    a MoENDCache measures them after a prompt of that length (the plan's own kept-token floor included).
    calibrated: the cache has calibrated query statistics (what ``prepare(model, plan, table=...)`` gives it
    from a table that has them; a table without them prices its configs with ``calibrated=False``)."""
    t = plan.context_length if tokens is None else tokens
    return [plan_layer_parts(c, t, plan.fingerprint, group_size=plan.group_size, batch=batch,
                             floor=keep_floor(plan), scorer=plan.scorer, calibrated=calibrated, layer=i)
            for i, c in enumerate(plan.layers)]


def plan_bytes(plan: PlanShape, tokens: int | None = None, batch: int = 1, calibrated: bool = True) -> int:
    """Bytes of the whole plan: the sum of :func:`plan_parts` (same arguments)."""
    return sum(sum(p.values()) for p in plan_parts(plan, tokens, batch, calibrated))


def full_cache_bytes(model_or_fp: Any, tokens: int, batch: int = 1, dtype: Any = "16bit") -> int:
    """Bytes of an uncompressed K/V cache as transformers holds it (``DynamicCache``: a sliding-window layer keeps
    ``min(tokens, window - 1)`` tokens, the others every token: a hybrid such as Gemma 3 is priced as its own
    hybrid cache). ``dtype="16bit"`` (default) is the paper's base; ``None`` means the model's own dtype; or any
    dtype name."""
    fp = model_or_fp if isinstance(model_or_fp, ModelFingerprint) else ModelFingerprint.from_model(model_or_fp)
    if dtype == "16bit":
        eb = 2
    elif dtype is None:
        eb = dtype_bytes(fp.dtype)
    else:
        eb = dtype_bytes(dtype)
    held = sum(fp.layer_tokens(i, tokens) for i in range(fp.num_layers))
    return held * batch * fp.num_kv_heads * fp.head_dim * 2 * eb


@dataclass(frozen=True)
class Budget:
    """A byte budget and a sentence that says what it was measured against."""

    bytes: int
    base: str

    def __str__(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.base})"


_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATIO_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*x\s*$", re.IGNORECASE)


def parse_budget(budget: Any, fp: ModelFingerprint, context_length: int, batch: int = 1) -> Budget:
    """Parse a budget: bytes (int), a size string ("136MB", "1.5GiB") or a ratio ("14x").

    A ratio ``Nx`` is 1/N of a **16-bit** cache of ``context_length`` tokens, whatever the model's dtype,
    so our ratios compare with the paper's (design.md, evaluation protocol); for a sliding-window hybrid, of its
    16-bit hybrid cache (:func:`full_cache_bytes`: sliding layers keep their window).
    """
    full16 = full_cache_bytes(fp, context_length, batch, dtype="16bit")
    base16 = f"16-bit cache of {context_length} tokens = {format_bytes(full16)}"
    if isinstance(budget, bool):
        raise BudgetError(f"budget {budget!r} is not a size; use bytes, '136MB', '1.5GiB' or '14x'")
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"budget {budget} must be a positive number of bytes")
        return Budget(budget, f"{full16 / budget:.2f}x vs the {base16}")
    if not isinstance(budget, str):
        raise BudgetError(f"budget {budget!r} is not a size; use bytes, '136MB', '1.5GiB' or '14x'")
    m = _RATIO_RE.match(budget)
    if m:
        ratio = float(m.group(1))
        if ratio < 1.0:
            raise BudgetError(f"budget ratio {budget!r} must be >= 1x (1x = the whole 16-bit cache)")
        return Budget(int(full16 / ratio), f"{ratio:g}x vs the {base16}")
    m = _SIZE_RE.match(budget)
    if m and m.group(2).lower() in _UNITS | {"": 1}:
        b = int(float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1))
        if b <= 0:
            raise BudgetError(f"budget {budget!r} must be positive")
        return Budget(b, f"{full16 / b:.2f}x vs the {base16}")
    raise BudgetError(
        f"budget {budget!r} does not parse; allowed: bytes (e.g. 3300000), a size with unit "
        f"{sorted(_UNITS)} (e.g. '136MB', '1.5GiB'), or a ratio of the 16-bit cache (e.g. '14x')"
    )


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
