"""examples/split_gains.py: the split prediction and its probes (on a synthetic table; no model)."""

from __future__ import annotations

import numpy as np
import pytest

from moend_fx.calibration.tables import load_table
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import Grid, LayerConfig
from tests.examples.helpers import load_example


@pytest.fixture(scope="module")
def split():
    return load_example("split_gains")


def test_split_loss_prices_eviction_and_quantization_by_their_own_gains(split):
    table = load_table("synthetic:6:0")
    rng = np.random.default_rng(0)
    ge, gq = rng.uniform(0.1, 1.0, 6), rng.uniform(0.1, 1.0, 6)
    loss = split.split_loss(table.S, table.grid, ge, gq)
    j = {c: i for i, c in enumerate(table.grid.configs)}
    for c in (LayerConfig(0.25, 4, 8), LayerConfig(1.0, 8, 4), LayerConfig(0.1, 16, 16)):
        se = table.S[:, j[LayerConfig(c.keep_ratio, 16, 16)]]
        sq2 = np.maximum(table.S[:, j[c]] ** 2 - se ** 2, 0.0)
        np.testing.assert_allclose(loss[:, j[c]], ge * se ** 2 + gq * sq2, rtol=1e-12)  # float64 arithmetic
    # with equal gains it is the one-gain prediction wherever quantization adds error
    same = split.split_loss(table.S, table.grid, ge, ge)
    grows = (table.S ** 2) >= (table.S[:, [j[LayerConfig(c.keep_ratio, 16, 16)] for c in table.grid.configs]] ** 2)
    np.testing.assert_allclose(same[grows], (ge[:, None] * table.S ** 2)[grows], rtol=1e-12)


def test_a_grid_without_16_bit_configs_is_a_clear_error(split):
    grid = Grid(keep_ratios=(0.5, 1.0), k_bits=(4, 8), v_bits=(4, 8))
    with pytest.raises(MoendError, match=r"no 16/16 config at keep ratio\(s\) \[0.5, 1.0\]"):
        split.split_loss(np.ones((2, len(grid))), grid, np.ones(2), np.ones(2))


@pytest.mark.parametrize(("name", "quantizes", "ok"), [
    ("keep1_k4_v4", True, True), ("keep1_k16_v4", True, True), ("keep0.5_k4_v4", True, False),
    ("keep1_k16_v16", True, False), ("keep0.5_k16_v16", False, True), ("keep0.5_k8_v16", False, False),
    ("keep0.33_k16_v16", False, False)])
def test_probes_must_be_of_their_kind_and_in_the_grid(split, name, quantizes, ok):
    grid = load_table("synthetic:6:0").grid
    if ok:
        assert split.probe_config(name, grid, quantizes=quantizes) == LayerConfig.from_name(name)
    else:
        with pytest.raises(MoendError, match=f"probe '{name}' is not allowed; allowed: a config of the table's grid"):
            split.probe_config(name, grid, quantizes=quantizes)
