"""``moend bench heads``: the simulated cache against the eager reference and the real cache, its bytes, the runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.bench.head_budgets import VARIANTS, HeadBudgetBench, HeadBudgetSettings
from moend_fx.bench.head_report import write_report
from moend_fx.bench.head_sim import HEADSIM_ATTN, SimulatedLayer, headsim_attention, simulate, simulated
from moend_fx.common.errors import MoendError
from moend_fx.eval.methods import METHODS, build_cache, moend_options
from moend_fx.eval.plan_book import PlanBook
from moend_fx.eval.steps import EVAL_ATTN, eval_attention_on, prefill
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.plan.routing import LayerConfig, RoutingPlan
from moend_fx.storage.packed import PackedKV
from tests.eval import conftest as eval_fixtures
from tests.eval.test_runner import TOK

model, table = eval_fixtures.model, eval_fixtures.table  # the evaluation tests' tiny model and its table


class _Module:
    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


def _reference(q, k, v, keep, t, v_bits, group):
    """Naive loops: each query row over the tokens its KV head holds (kept prompt tokens, every token fed since,
    causal within the last L), with the tokens fed since stored as the cache stores them on arrival."""
    b, h, n_q, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    tail = PackedKV.from_dense(k[:, :, t:], v[:, :, t:], LayerConfig(1.0, 16, v_bits), group)
    kt, vt = tail.dequantize(k.dtype)
    k, v = torch.cat([k[:, :, :t], kt], 2), torch.cat([v[:, :, :t], vt], 2)
    out = torch.zeros(b, n_q, h, d, dtype=torch.float64)
    for i in range(b):
        for head in range(h):
            kv = head // (h // hkv)
            for j in range(n_q):
                vis = [u for u in range(s) if (u >= t or keep[i, kv, u]) and u <= s - n_q + j]
                logits = torch.stack([q[i, head, j].double() @ k[i, kv, u].double() for u in vis]) / math.sqrt(d)
                p = torch.softmax(logits, 0)
                out[i, j, head] = sum(p[x] * v[i, kv, u].double() for x, u in enumerate(vis))
    return out


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 3]), t=st.integers(8, 40),
       new=st.integers(1, 5), chunk=st.booleans(), v_bits=st.sampled_from([2, 4, 16]), seed=st.integers(0, 2**16))
def test_headsim_attention_matches_the_naive_reference(b, hkv, group, t, new, chunk, v_bits, seed):
    g = torch.Generator().manual_seed(seed)
    d, h = 16, hkv * group
    n_q = new if chunk else 1
    s = t + new
    q, k, v = (torch.randn(b, x, s if x == hkv else n_q, d, generator=g) for x in (h, hkv, hkv))
    keep = torch.rand(b, hkv, t, generator=g) < 0.6
    keep[..., 0] = True  # every head keeps a token of the prompt (the cache keeps its sinks)
    layer = SimulatedLayer(k[:, :, :t], v[:, :, :t], keep, keep.sum(-1), 0)
    plan_cfg = LayerConfig(0.5, 16, v_bits)
    plan = RoutingPlan.__new__(RoutingPlan)  # only .layers and .group_size are read by simulated()
    object.__setattr__(plan, "layers", (plan_cfg,))
    object.__setattr__(plan, "group_size", 8)
    with simulated([layer], plan):
        out, _ = headsim_attention(_Module(0), q, k, v, None, scaling=1 / math.sqrt(d))
    # fp32 SDPA vs a float64 loop over the same stored values: summation order only
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, t, v_bits, 8), atol=1e-5, rtol=1e-4)


def test_uniform_simulation_is_the_real_cache(model, table):
    """Same plan, same prompt: the uniform simulation holds the real cache's tokens with the real cache's values,
    so the first step's logits agree, and its storage bytes are the real cache's."""
    ex = make_examples("passkey", TOK, 400, n=1, seed=5)[0]
    ids = TOK(ex.prefill_text("query_aware"))["input_ids"]
    state = prefill(model, ids)
    kw = moend_options(model, table, window=32)
    plan = PlanBook(table).get("2d_hetero", "6x", state.length).plan
    assert plan is not None and any(c.evicts for c in plan.layers)
    cache = build_cache(METHODS["2d_hetero"], state, model=model, plan=plan, **kw)
    held = cache.held_tokens()
    layers = simulate(plan, state, "uniform", held=held, alpha=0.2, moend_kw=kw)
    assert sum(x.nbytes for x in layers) == cache.nbytes().total - cache.state_nbytes()
    from transformers import DynamicCache

    sim = DynamicCache(config=model.config)
    for layer, x in zip(sim.layers, layers):
        layer.update(x.keys, x.values)
    nxt = torch.tensor([[65, 66, 67]])
    with torch.inference_mode():
        with eval_attention_on(model, EVAL_ATTN):
            real = model(input_ids=nxt, cache=cache, use_cache=True).logits
        with simulated(layers, plan), eval_attention_on(model, HEADSIM_ATTN):
            ours = model(input_ids=nxt, cache=sim, use_cache=True).logits
    # same dequantized values; the cache's K of the 3 new tokens is fp16-rounded in both, SDPA vs the packed
    # reference attention differ in summation order only
    torch.testing.assert_close(ours, real, atol=1e-4, rtol=1e-4)


def test_ada_counts_differ_by_head_and_keep_the_layer_total(model, table):
    ex = make_examples("niah_single", TOK, 400, n=1, seed=6)[0]
    state = prefill(model, TOK(ex.prefill_text("query_aware"))["input_ids"])
    kw = moend_options(model, table, window=32)
    plan = PlanBook(table).get("2d_hetero", "6x", state.length).plan
    held = build_cache(METHODS["2d_hetero"], state, model=model, plan=plan, **kw).held_tokens()
    layers = simulate(plan, state, "ada", held=held, alpha=0.0, moend_kw=kw)
    for x, n, cfg in zip(layers, held, plan.layers):
        assert (x.counts.sum(-1) == n * x.counts.shape[1]).all()
        assert (x.keep is None) == (not cfg.evicts)
    assert any(x.keep is not None and int(x.counts.max()) != int(x.counts.min()) for x in layers)


def test_runs_resume_and_report(model, table, tmp_path):
    s = HeadBudgetSettings(task="passkey", length=300, n=1, budgets=("6x",))
    recs = HeadBudgetBench(model, TOK, table, s, progress=False).run(tmp_path)
    assert sorted((r["setting"], r["variant"]) for r in recs) == sorted(
        (st_, v) for st_ in ("query_aware", "query_agnostic") for v in VARIANTS)
    by = {(r["setting"], r["variant"]): r for r in recs}
    for st_ in ("query_aware", "query_agnostic"):
        # the uniform simulation stores exactly the real cache's bytes
        assert by[st_, "uniform"]["bytes"] == by[st_, "moend"]["bytes"]
        assert all(0.0 <= by[st_, v]["score"] <= 1.0 for v in VARIANTS)
    saved = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(saved) == 6
    again = HeadBudgetBench(model, TOK, table, s, progress=False).run(tmp_path)
    assert again == [json.loads(x) for x in saved]  # nothing left to run
    paths = write_report(again, s, tmp_path)
    md = paths["markdown"].read_text()
    assert "| query_aware | 6x | ada | 1 |" in md and "uniform answers as moend" in md
    assert json.loads(paths["json"].read_text())["rows"]


@pytest.mark.parametrize("kw, match", [
    (dict(task="nope"), "task 'nope' is unknown"),
    (dict(method="full"), "method 'full' has no budgeted MoENDCache plan; allowed: .*2d_hetero"),
    (dict(alpha=2.0), r"alpha=2.0; must be a number in \[0, 1\]"),
    (dict(settings=("sometimes",)), "setting='sometimes' is unknown"),
    (dict(budgets=()), "budgets and settings"),
])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(MoendError, match=match):
        HeadBudgetSettings(**kw)
