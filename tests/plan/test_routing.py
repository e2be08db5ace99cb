import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.common.errors import PlanError
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan

FP = ModelFingerprint("LlamaForCausalLM", 3, 2, 16, 4, "float32")
GRID = Grid()


def make_plan(configs, **kw):
    return RoutingPlan(layers=tuple(configs), fingerprint=FP, budget_bytes=10_000, context_length=256, **kw)


def test_default_grid_is_the_papers_54():
    assert len(GRID) == len(GRID.configs) == 54
    assert GRID.configs[0] == LayerConfig(0.1, 16, 16)
    assert GRID.configs[-1] == LayerConfig(1.0, 4, 4)
    assert GRID.index(LayerConfig(1.0, 16, 16)) == 45


@given(st.lists(st.sampled_from(GRID.configs), min_size=3, max_size=3), st.integers(1, 10**9))
def test_plan_json_round_trip(configs, budget):
    plan = RoutingPlan(layers=tuple(configs), fingerprint=FP, budget_bytes=budget, context_length=2048,
                       solver="greedy", predicted_loss=0.5)
    again = RoutingPlan.from_json(plan.to_json())
    assert again == plan


def test_save_load_atomic(tmp_path):
    plan = make_plan([LayerConfig(0.5, 4, 8)] * 3)
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert RoutingPlan.load(path) == plan
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temp file left behind


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace"])
def test_failed_save_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, fail_at):
    """A save that fails mid-write (the write, the flush to disk, or the rename) leaves the previous plan file
    byte-identical and no temp file beside it; the error reaches the caller."""
    import moend_fx.common.io as io_mod

    old = make_plan([LayerConfig(1.0, 16, 16)] * 3)
    path = old.save(tmp_path / "plan.json")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(f"disk full during {fail_at}")

    if fail_at == "write":
        real_fdopen = io_mod.os.fdopen

        class HalfWriter:
            """Writes half the bytes, then fails: a temp file with partial content exists at that point."""

            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                boom()

            def __getattr__(self, name):
                return getattr(self.f, name)

        monkeypatch.setattr(io_mod.os, "fdopen", lambda fd, mode: HalfWriter(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(io_mod.os, fail_at, boom)
    new = make_plan([LayerConfig(0.5, 4, 8)] * 3)
    with pytest.raises(OSError, match=f"during {fail_at}"):
        new.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and RoutingPlan.load(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("kw,msg", [
    ({"keep_ratio": 0.0, "k_bits": 4, "v_bits": 4}, r"outside the allowed range \(0, 1\]"),
    ({"keep_ratio": 1.5, "k_bits": 4, "v_bits": 4}, "outside the allowed range"),
    ({"keep_ratio": 0.5, "k_bits": 3, "v_bits": 4}, r"k_bits=3 .*allowed: \[2, 4, 8, 16\]"),
    ({"keep_ratio": 0.5, "k_bits": 4, "v_bits": 32}, "v_bits=32"),
    ({"keep_ratio": float("nan"), "k_bits": 4, "v_bits": 4}, "not a number"),
])
def test_bad_layer_config(kw, msg):
    with pytest.raises(PlanError, match=msg):
        LayerConfig(**kw)


def test_plan_for_other_model_is_clear_error():
    plan = make_plan([LayerConfig(1.0, 16, 16)] * 3)
    other = ModelFingerprint("LlamaForCausalLM", 3, 2, 32, 4)
    with pytest.raises(PlanError, match="head_dim=16.*head_dim=32"):
        plan.check_model(other)
    plan.check_model(FP)


def test_wrong_layer_count():
    with pytest.raises(PlanError, match="2 layer configs.*num_layers=3"):
        make_plan([LayerConfig(1.0, 16, 16)] * 2)


@pytest.mark.parametrize("text,msg", [
    ("{not json", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ('{"format": "other"}', "not a moend_fx plan"),
])
def test_malformed_json(text, msg):
    with pytest.raises(PlanError, match=msg):
        RoutingPlan.from_json(text)


def test_tampered_fields_named():
    d = make_plan([LayerConfig(0.5, 4, 4)] * 3).to_dict()
    d["layers"][1]["k_bits"] = 5
    with pytest.raises(PlanError, match=r"layers\[1\].*k_bits=5"):
        RoutingPlan.from_dict(json.loads(json.dumps(d)))
    d = make_plan([LayerConfig(0.5, 4, 4)] * 3).to_dict()
    d["version"] = 99
    with pytest.raises(PlanError, match="version=99"):
        RoutingPlan.from_dict(d)
    d = make_plan([LayerConfig(0.5, 4, 4)] * 3).to_dict()
    d["layers"][0]["keep_ratio"] = 0.3
    with pytest.raises(PlanError, match="not in the plan's grid"):
        RoutingPlan.from_dict(d)
    d = make_plan([LayerConfig(0.5, 4, 4)] * 3).to_dict()
    del d["budget_bytes"]
    with pytest.raises(PlanError, match="missing"):
        RoutingPlan.from_dict(d)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        RoutingPlan.load(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PlanError, match="not UTF-8"):
        RoutingPlan.load(tmp_path / "bin.json")


def test_bad_grid():
    with pytest.raises(PlanError, match="empty"):
        Grid(keep_ratios=())
    with pytest.raises(PlanError, match="duplicates"):
        Grid(k_bits=(4, 4))
    with pytest.raises(PlanError, match=r"grid.v_bits\[0\]=7"):
        Grid(v_bits=(7,))
    assert len(Grid(k_bits=(16, 8, 4, 2), v_bits=(16, 8, 4, 2))) == 96  # 2-bit extension


def test_bit_widths_are_held_as_ints_and_scorers_as_names():
    from moend_fx.common.options import ScorerName

    c = LayerConfig(0.5, 4.0, 8)  # a JSON writer may give 4.0: the config holds the int
    assert type(c.k_bits) is int and c == LayerConfig(0.5, 4, 8)
    plan = make_plan([LayerConfig(1.0, 16, 16)] * 3, scorer=ScorerName.SNAPKV)
    assert type(plan.scorer) is str and plan.scorer == "snapkv"
    assert RoutingPlan.from_json(plan.to_json()) == plan


def test_bad_plan_fields():
    with pytest.raises(PlanError, match="group_size=24"):
        make_plan([LayerConfig(1.0, 16, 16)] * 3, group_size=24)
    with pytest.raises(PlanError, match="scorer='magic'"):
        make_plan([LayerConfig(1.0, 16, 16)] * 3, scorer="magic")
