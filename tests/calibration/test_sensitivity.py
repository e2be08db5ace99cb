"""SensitivityTable: validation, bytes matrix, safetensors save/load, tamper and model checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.stats_arrays import stats_to_arrays
from moend_fx.common.errors import MoendError, TableError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.plan.memory import plan_layer_bytes
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan

FP = ModelFingerprint("LlamaForCausalLM", num_layers=3, num_kv_heads=2, head_dim=16, num_heads=4)


def make_table(seed: int = 0, fp: ModelFingerprint = FP, grid: Grid | None = None,
               with_stats: bool = True) -> SensitivityTable:
    grid = grid or Grid()
    rng = np.random.default_rng(seed)
    S = rng.uniform(0.01, 2.0, size=(fp.num_layers, len(grid)))
    stats = {}
    if with_stats:
        g = torch.Generator().manual_seed(seed)
        for l in range(fp.num_layers):
            stats[l] = QueryStats.empty(fp.num_heads, fp.head_dim).accumulate(
                torch.randn(1, fp.num_heads, 7, fp.head_dim, generator=g))
    return SensitivityTable(S=S, grid=grid, fingerprint=fp, group_size=32,
                            calibration={"tokens": 128, "seed": seed, "scorer": "trig"},
                            query_stats=stats_to_arrays(stats))


def assert_same(a: SensitivityTable, b: SensitivityTable) -> None:
    assert a.S.dtype == b.S.dtype == np.float64
    assert a.S.tobytes() == b.S.tobytes()  # bit-exact
    assert (a.grid, a.fingerprint, a.group_size, a.calibration) == (b.grid, b.fingerprint, b.group_size,
                                                                    b.calibration)
    assert (a.gain is None) == (b.gain is None)
    assert a.gain is None or a.gain.tobytes() == b.gain.tobytes()
    assert sorted(a.query_stats) == sorted(b.query_stats)
    for k in a.query_stats:
        assert a.query_stats[k].dtype == b.query_stats[k].dtype
        assert a.query_stats[k].tobytes() == b.query_stats[k].tobytes()


def test_round_trip_bit_exact(tmp_path):
    t = make_table()
    p = t.save(tmp_path / "t.safetensors")
    back = SensitivityTable.load(p)
    assert_same(t, back)
    # statistics come back as usable QueryStats
    qs = back.layer_stats(1)
    assert qs.count == 7 and qs.num_heads == FP.num_heads and qs.head_dim == FP.head_dim
    torch.testing.assert_close(qs.mean, t.layer_stats(1).mean, rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 5), keeps=st.lists(st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0]), min_size=1,
                                                 max_size=3, unique=True),
       seed=st.integers(0, 2**16))
def test_round_trip_shapes(tmp_path_factory, layers, keeps, seed):
    fp = ModelFingerprint("X", num_layers=layers, num_kv_heads=1, head_dim=8, num_heads=2)
    t = make_table(seed, fp, Grid(tuple(keeps), (16, 4), (8,)))
    p = t.save(tmp_path_factory.mktemp("rt") / "t.safetensors")
    assert_same(t, SensitivityTable.load(p))


def test_round_trip_without_stats(tmp_path):
    t = make_table(with_stats=False)
    back = SensitivityTable.load(t.save(tmp_path / "t.safetensors"))
    assert_same(t, back)
    assert not back.has_stats()
    with pytest.raises(TableError, match="no query statistics for layer 0"):
        back.layer_stats(0)


def test_missing_file(tmp_path):
    with pytest.raises(TableError, match="does not exist"):
        SensitivityTable.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("cut", [0, 5, 40, -1, -17])
def test_truncated_file(tmp_path, cut):
    data = make_table().to_bytes()
    p = tmp_path / "t.safetensors"
    p.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(TableError):
        SensitivityTable.load(p)


def test_tampered_tensor_bytes(tmp_path):
    data = bytearray(make_table().to_bytes())
    data[-3] ^= 0x10  # one bit of the last tensor's data
    p = tmp_path / "t.safetensors"
    p.write_bytes(bytes(data))
    with pytest.raises(TableError, match="sha256"):
        SensitivityTable.load(p)


def test_tampered_metadata(tmp_path):
    data = make_table().to_bytes()
    # same-length edit inside the JSON header: group_size 32 -> 64
    assert data.count(b'\\"group_size\\": 32') == 1
    bad = data.replace(b'\\"group_size\\": 32', b'\\"group_size\\": 64')
    p = tmp_path / "t.safetensors"
    p.write_bytes(bad)
    with pytest.raises(TableError, match="sha256"):
        SensitivityTable.load(p)


def test_not_a_table(tmp_path):
    from safetensors.numpy import save

    p = tmp_path / "other.safetensors"
    p.write_bytes(save({"x": np.ones(3)}))
    with pytest.raises(TableError, match="no metadata"):
        SensitivityTable.load(p)
    p.write_bytes(save({"x": np.ones(3)}, metadata={"format": "something.else"}))
    with pytest.raises(TableError, match="not a sensitivity table"):
        SensitivityTable.load(p)
    p.write_bytes(b"\x00" * 64)
    with pytest.raises(TableError):
        SensitivityTable.load(p)


def test_wrong_version(tmp_path):
    from safetensors.numpy import load, save

    data = make_table().to_bytes()
    from safetensors import safe_open

    p = tmp_path / "t.safetensors"
    p.write_bytes(data)
    with safe_open(str(p), "np") as f:
        meta = dict(f.metadata())
    meta["version"] = "99"
    p.write_bytes(save(load(data), metadata=meta))
    with pytest.raises(TableError, match="version='99'"):
        SensitivityTable.load(p)


def test_stats_shape_mismatch_is_reported(tmp_path):
    t = make_table()
    fp2 = ModelFingerprint("LlamaForCausalLM", num_layers=3, num_kv_heads=2, head_dim=16, num_heads=2)
    with pytest.raises(TableError, match="num_heads=2"):
        # a hand-made table whose stats disagree with its fingerprint fails at load time
        bad = SensitivityTable(S=t.S, grid=t.grid, fingerprint=fp2, group_size=32, calibration={},
                               query_stats=t.query_stats)
        SensitivityTable.load(bad.save(tmp_path / "t.safetensors"))


def test_shape_must_match_grid_and_model():
    with pytest.raises(TableError, match=r"expected \(3, 54\)"):
        SensitivityTable(S=np.ones((3, 53)), grid=Grid(), fingerprint=FP)
    with pytest.raises(TableError, match="non-finite"):
        SensitivityTable(S=np.full((3, 54), np.nan), grid=Grid(), fingerprint=FP)
    assert issubclass(TableError, MoendError)


def test_check_model_names_the_field():
    t = make_table()
    t.check_model(FP)
    other = ModelFingerprint("LlamaForCausalLM", num_layers=4, num_kv_heads=2, head_dim=16, num_heads=4)
    with pytest.raises(TableError, match="num_layers=3.*num_layers=4"):
        t.check_model(other)
    from moend_fx.models import tiny_model

    with pytest.raises(TableError, match="num_layers"):
        t.check_model(tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))


def test_bytes_matrix_contract():
    t = make_table()
    B = t.bytes_matrix(1000, batch=2)
    assert B.shape == (3, 54) and B.dtype == np.int64
    for c_idx, c in enumerate(t.grid.configs):
        assert B[1, c_idx] == plan_layer_bytes(c, 1000, FP, group_size=32, batch=2)


def test_predicted_loss_and_spread():
    t = make_table()
    cfgs = [LayerConfig(0.25, 16, 16), LayerConfig(1.0, 8, 4), LayerConfig(1.0, 16, 16)]
    want = sum(t.S[l, t.grid.index(c)] for l, c in enumerate(cfgs))
    assert t.predicted_loss(cfgs) == pytest.approx(want, rel=1e-12)  # same sum, order may differ
    plan = RoutingPlan(layers=tuple(cfgs), fingerprint=FP, budget_bytes=1, context_length=10)
    assert t.predicted_loss(plan) == pytest.approx(want, rel=1e-12)
    col = t.column(LayerConfig(0.25, 16, 16))
    assert t.spread(LayerConfig(0.25, 16, 16)) == pytest.approx(col.max() / col.min())
    with pytest.raises(TableError, match="not in the grid"):
        t.column(LayerConfig(0.3, 16, 16))
    with pytest.raises(TableError, match="2 layer configs"):
        t.predicted_loss(cfgs[:2])


def test_metadata_is_json_readable(tmp_path):
    from safetensors import safe_open

    p = make_table().save(tmp_path / "t.safetensors")
    with safe_open(str(p), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "moend_fx.calibration.sensitivity" and meta["version"] == "1"
    body = json.loads(meta["meta"])
    assert body["model"]["num_layers"] == 3 and body["grid"]["k_bits"] == [16, 8, 4]


def test_cli_show_table(tmp_path, capsys):
    from moend_fx.cli import main

    p = make_table().save(tmp_path / "t.safetensors")
    png = tmp_path / "heat.png"
    assert main(["show-table", str(p), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "3 layers" in out and "per-layer spread" in out and "evict 75%" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show-table", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bytes_matrix_prices_the_eviction_state_of_the_scorer_the_cache_will_use():
    from moend_fx.plan.scorer_state import scorer_state_bytes

    table = make_table()
    base = table.bytes_matrix(512)
    evicting = np.array([c.evicts for c in table.grid.configs])
    kw = dict(num_heads=FP.num_heads, head_dim=FP.head_dim)
    storage = np.array([plan_layer_bytes(c, 512, FP, scorer=None) for c in table.grid.configs])
    # the table's own scorer, trig, with its calibrated statistics: stats + one RoPE offset per evicting layer
    stats = scorer_state_bytes(LayerConfig(0.5, 4, 4), 512, scorer="trig", **kw)
    assert stats == FP.num_heads * (FP.head_dim // 2) * 24 + 8
    assert (base[0] == storage + evicting * stats).all()
    # a cache that overrides the scorer with snapkv keeps a 32-query window instead
    snap = table.priced_for("snapkv", calibrated=False).bytes_matrix(512)
    window = scorer_state_bytes(LayerConfig(0.5, 4, 4), 512, scorer="snapkv", **kw)
    assert window == 8 + FP.num_heads * 32 * FP.head_dim * 2 + 32 * 4 + 32 * 4
    assert (snap[0] == storage + evicting * window).all()
    assert table.priced_for("snapkv", calibrated=False) == table  # pricing is not part of the table's data
    no_stats = make_table(with_stats=False)
    assert (no_stats.bytes_matrix(512)[0] == snap[0]).all()  # trig without statistics keeps the same window


def test_gains_make_the_loss_an_end_to_end_estimate_and_round_trip(tmp_path):
    """With gains, loss = gain[l] * S**2 (what predicted_loss sums and the solvers minimise); saved and loaded
    bit for bit; without, loss is S itself."""
    t = make_table()
    assert t.gain is None and t.loss is t.S
    gain = np.array([0.5, 2.0, 40.0])
    g = SensitivityTable(S=t.S, grid=t.grid, fingerprint=FP, group_size=32, calibration=t.calibration,
                         query_stats=t.query_stats, gain=gain)
    np.testing.assert_array_equal(g.loss, gain[:, None] * t.S ** 2)
    cfgs = [LayerConfig(0.25, 16, 16), LayerConfig(1.0, 8, 4), LayerConfig(0.5, 4, 4)]
    want = sum(gain[l] * t.S[l, t.grid.index(c)] ** 2 for l, c in enumerate(cfgs))
    assert g.predicted_loss(cfgs) == pytest.approx(want, rel=1e-12)
    g.save(tmp_path / "g.safetensors")
    assert_same(SensitivityTable.load(tmp_path / "g.safetensors"), g)


@pytest.mark.parametrize("gain", [np.array([1.0, 2.0]), np.array([1.0, 0.0, 2.0]), np.array([1.0, np.nan, 2.0]),
                                  np.array([1.0, -1.0, 2.0])])
def test_bad_gains_are_refused(gain):
    t = make_table()
    with pytest.raises(TableError, match="gain must be"):
        SensitivityTable(S=t.S, grid=t.grid, fingerprint=FP, group_size=32, gain=gain)


def test_solvers_minimise_the_gained_loss():
    """The same S with gains that make layer 0 the most sensitive: the greedy plan spends its bytes there."""
    from moend_fx.solvers import get_solver

    grid = Grid((0.25, 1.0), (16,), (16,))
    S = np.tile([[0.5, 0.0]], (3, 1))  # keep 0.25 costs the same error on every layer
    plain = SensitivityTable(S=S, grid=grid, fingerprint=FP, group_size=32)
    gained = SensitivityTable(S=S, grid=grid, fingerprint=FP, group_size=32, gain=np.array([100.0, 1.0, 1.0]))
    budget = int(plain.bytes_matrix(256)[0].sum() + plain.bytes_matrix(256)[0, 0])  # one layer full, two evict
    plan = get_solver("exact").solve(gained, budget, context_length=256).plan
    assert [c.keep_ratio for c in plan.layers] == [1.0, 0.25, 0.25]
    assert get_solver("greedy").solve(gained, budget, context_length=256).predicted_loss == pytest.approx(0.5)
    assert get_solver("exact").solve(plain, budget, context_length=256).predicted_loss == pytest.approx(1.0)
