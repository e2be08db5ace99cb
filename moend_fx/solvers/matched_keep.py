"""A uniform plan at matched bytes: raise its keep ratio until the plan spends the budget.

The uniform baselines choose from the grid's keep ratios (0.1, 0.25, ...), so at a tight budget the best uniform
config that fits can hold far fewer bytes than the budget: ``2d_uniform`` at "14x" keeps 0.1 of the tokens at
K8/V8 and measures 16.8-17.3x, while MoE-nD's per-layer plan spends its budget (14.2-14.6x at its peak). A
comparison "at matched bytes" needs the baseline to spend the same bytes, so :func:`fill_keep` keeps the uniform
plan's bit widths and raises its one keep ratio to the largest token count whose bytes, priced by the same memory
model the cache and the solvers use, still fit the budget. The keep ratio is then off the table's grid: the plan
carries a grid of that one config (so it saves and loads as any plan), and its predicted loss is the table's,
interpolated linearly in keep between the neighbouring grid ratios at the same bits (a reading, not a
measurement; nothing is chosen by it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import PlanError
from moend_fx.plan.memory import DEFAULT_KEEP_FLOOR, keep_count
from moend_fx.plan.routing import Grid, LayerConfig
from moend_fx.solvers.base import SolveResult

MATCHED_SUFFIX = "_matched"
"""Appended to the solver name of a filled plan (``2d_uniform`` -> ``2d_uniform_matched``)."""


def interpolated_loss(table: SensitivityTable, config: LayerConfig) -> float:
    """The table's predicted loss of ``config`` on every layer, linear in keep between the grid's ratios at the
    config's K / V bits (clamped to the grid's ends)."""
    cols = [i for i, c in enumerate(table.grid.configs)
            if c.k_bits == config.k_bits and c.v_bits == config.v_bits]
    if not cols:
        raise PlanError(f"K{config.k_bits}/V{config.v_bits} is not in the table's grid {table.grid.describe()}")
    keeps = np.array([table.grid.configs[i].keep_ratio for i in cols])
    order = np.argsort(keeps)
    loss = table.loss[:, np.asarray(cols)[order]]
    return float(sum(np.interp(config.keep_ratio, keeps[order], row) for row in loss))


def uniform_bytes(table: SensitivityTable, config: LayerConfig, context_length: int) -> int:
    """Bytes of ``config`` on every layer at ``context_length`` tokens, each layer priced as the table's byte
    matrix prices it (a sliding-window layer by its window: ``SensitivityTable.config_bytes``)."""
    fp = table.fingerprint
    full = table.config_bytes(config, context_length)
    sliding = table.config_bytes(config, context_length, layer=fp.sliding[0]) if fp.sliding else 0
    return sum(sliding if fp.is_sliding(i) else full for i in range(table.num_layers))


def largest_keep(table: SensitivityTable, config: LayerConfig, budget_bytes: int, context_length: int) -> LayerConfig:
    """``config`` with the largest keep ratio whose plan (``config`` on every layer) fits ``budget_bytes`` at
    ``context_length`` tokens, never below ``config``'s own keep. The ratio is ``n / context_length`` for a
    whole token count ``n``, so the cache keeps exactly ``n`` tokens. Bytes are not monotonic in ``n`` (a full
    group packs, a partial one stays 16-bit), so every count is priced, from the top down."""
    # the table prices every config with the default kept-token floor, and so do the plans solved on it
    start = keep_count(context_length, config.keep_ratio, DEFAULT_KEEP_FLOOR)
    for n in range(context_length, start - 1, -1):
        filled = LayerConfig(n / context_length, config.k_bits, config.v_bits)
        if uniform_bytes(table, filled, context_length) <= budget_bytes:
            return filled
    # ``config`` itself (its keep count ``start`` too): on a sliding layer its grid ratio can keep fewer tokens of
    # the window than start / context_length does, so it can fit where that ratio does not
    if uniform_bytes(table, config, context_length) <= budget_bytes:
        return config
    raise PlanError(f"{config.name} does not fit {budget_bytes} bytes at {context_length} tokens; fill a plan "
                    "that fits its budget")


def fill_keep(result: SolveResult, table: SensitivityTable) -> SolveResult:
    """``result`` (a uniform plan: one config on every layer) with its keep ratio raised by :func:`largest_keep`
    to spend ``result.budget``; the solver's name gains :data:`MATCHED_SUFFIX`."""
    plan = result.plan
    configs = set(plan.layers)
    if len(configs) != 1:
        raise PlanError(f"fill_keep needs a uniform plan (one config on every layer); {plan.solver!r} gave "
                        f"{len(configs)} configs")
    filled = largest_keep(table, plan.layers[0], result.budget.bytes, plan.context_length)
    used = uniform_bytes(table, filled, plan.context_length)
    loss = interpolated_loss(table, filled)
    new = dataclasses.replace(
        plan, layers=(filled,) * plan.num_layers, grid=Grid((filled.keep_ratio,), (filled.k_bits,), (filled.v_bits,)),
        solver=plan.solver + MATCHED_SUFFIX, predicted_loss=loss, bytes_planned=used,
    )
    info = {**result.info, "filled_from": plan.layers[0].name, "loss_interpolated": True}
    return dataclasses.replace(result, plan=new, indices=(0,) * plan.num_layers, predicted_loss=loss,
                               bytes_used=used, info=info)

