"""Where tables live and how a table is named: the one default path, table specs, the default context."""

from __future__ import annotations

import pytest

from moend_fx.calibration.tables import (
    default_table_path,
    layer_query_stats,
    load_table,
    per_setting_paths,
    require_table,
    setting_tables,
    table_context_length,
)
from moend_fx.common.errors import MoendError, TableError
from moend_fx.solvers.synthetic import synthetic_table


def test_default_table_path(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEND_CACHE", str(tmp_path))
    assert default_table_path() == tmp_path / "tables" / "smollm2-135m-trig-2048.safetensors"
    # a model folder or hub name: its last part, lower-cased
    assert default_table_path("HuggingFaceTB/SmolLM2-135M", 96).name == "smollm2-135m-trig-96.safetensors"
    assert default_table_path("./x/Tiny", scorer="snapkv").name == "tiny-snapkv-2048.safetensors"


def test_table_specs(tmp_path):
    t = load_table("synthetic:4:2")
    assert t.num_layers == 4 and t.calibration["seed"] == 2
    path = synthetic_table(3).save(tmp_path / "t.safetensors")
    assert load_table(str(path)).num_layers == 3 and require_table(path).num_layers == 3
    for bad in ("synthetic:x", "synthetic:0", "synthetic:3:1:2"):
        with pytest.raises(TableError, match="synthetic:LAYERS"):
            load_table(bad)
    with pytest.raises(TableError, match="does not exist"):
        load_table(str(tmp_path / "nope.safetensors"))
    with pytest.raises(TableError, match="moend calibrate"):
        require_table(tmp_path / "nope.safetensors")


def test_context_length_and_stats():
    t = synthetic_table(3, context_length=512)
    assert table_context_length(t) == 512 and table_context_length(t, 100) == 100
    assert table_context_length(synthetic_table(3, context_length=0)) == 2048  # no length recorded: the default
    assert layer_query_stats(t) is None  # synthetic tables carry no query statistics


def test_per_setting_tables_from_one_option(tmp_path, monkeypatch):
    """`moend eval --table query_aware=A,query_agnostic=B`: each setting its own file; one not named keeps its
    cached default; a bad item names the allowed settings."""
    monkeypatch.setenv("MOEND_CACHE", str(tmp_path / "cache"))
    a = synthetic_table(3, seed=1).save(tmp_path / "a.safetensors")
    b = synthetic_table(3, seed=2).save(tmp_path / "b.safetensors")
    both = ("query_aware", "query_agnostic")
    tables, paths, _ = setting_tables("tiny", both, f"query_aware={a},query_agnostic={b}")
    assert paths == {"query_aware": a, "query_agnostic": b}
    assert tables["query_aware"].calibration["seed"] == 1 and tables["query_agnostic"].calibration["seed"] == 2
    tables, paths, _ = setting_tables("tiny", both, str(a))  # one path: every setting, one table loaded
    assert set(paths.values()) == {a} and tables["query_aware"] is tables["query_agnostic"]
    assert per_setting_paths(f"query_agnostic={b}", both) == {"query_agnostic": b}
    with pytest.raises(TableError, match="moend calibrate"):  # query_aware's default is not cached here
        setting_tables("tiny", both, f"query_agnostic={b}")
    for bad, match in ((f"query_awre={a}", "SETTING one of query_aware, query_agnostic"),
                       ("query_aware=", "expected SETTING=PATH"),
                       (f"query_aware={a},query_aware={b}", "names setting query_aware twice")):
        with pytest.raises(MoendError, match=match):
            per_setting_paths(bad, both)
