"""The evaluation runner on tiny random models with a byte-level tokenizer stand-in (fast), plus one slow
real-model check (SmolLM2-135M passkey at 2k: full cache >= 90%, lossless MoENDCache identical)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import (
    METHODS,
    build_cache,
    cache_nbytes,
    check_methods,
    hf_backend_available,
)
from moend_fx.eval.plan_book import PlanBook, lossless_plan
from moend_fx.eval.runner import Runner
from moend_fx.eval.steps import EVAL_ATTN, QueryRecorder, greedy_decode, prefill, stop_reason
from moend_fx.eval.tasks.registry import Example, make_examples
from moend_fx.models import tiny_model
from moend_fx.plan.memory import keep_count, keep_floor, plan_bytes
from moend_fx.plan.routing import Grid, ModelFingerprint


class ByteTokenizer:
    """Stand-in for a HF tokenizer over a 256-token vocabulary: one token per UTF-8 byte, no specials."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TOK = ByteTokenizer()
MOEND_METHODS = ("lossless", "1d", "2d_uniform", "2d_uniform_matched", "2d", "pyramid", "2d_hetero", "2d_hetero_exact")


@pytest.fixture(scope="module")
def example():
    return make_examples("passkey", TOK, 360, n=1, seed=3)[0]


def _ids(ex: Example, setting: str) -> tuple[list[int], list[int]]:
    return TOK(ex.prefill_text(setting))["input_ids"], TOK(ex.suffix_text(setting))["input_ids"]


# ------------------------------------------------------------------------------------------------ end to end


def test_runner_end_to_end_record_grid(model, table, tmp_path):
    methods = ("full", "hf_fp8", "hf_quant4", *MOEND_METHODS)
    # n = 1: two examples (one per task) already check the grid and the per-example saving; n = 2 cost 67 s.
    cfg = EvalConfig(tasks=("passkey", "niah_single"), lengths=(500,), n=1, budgets=("4x", "8x"), methods=methods,
                     max_new_tokens=6)
    res = Runner(model, TOK, table, cfg, progress=False).run(tmp_path)
    ran, skipped = check_methods(methods)
    assert ("hf_quant4" in skipped) == (not hf_backend_available("quanto"))
    per_setting = sum(len(cfg.budgets) if METHODS[m].budgeted else 1 for m in ran)
    assert len(res.records) == 2 * 1 * 2 * per_setting  # tasks x n x settings x (method, budget)
    for r in res.records:
        assert r["setting"] in ("query_aware", "query_agnostic")
        if r.get("infeasible"):
            assert r["score"] is None and r["measured_bytes"] is None
            continue
        assert 0.0 <= r["score"] <= 1.0
        assert r["measured_bytes"] > 0 and r["ratio16"] == pytest.approx(r["full16_bytes"] / r["measured_bytes"])
        if r["budget_bytes"] is not None:
            assert r["measured_bytes"] <= r["budget_bytes"], r  # measured memory honours the budget
            assert r["peak_bytes"] <= r["budget_bytes"], r  # ... at every step of the question and answer
        assert r["peak_bytes"] >= r["measured_bytes"]
        assert r["peak_ratio16"] == pytest.approx(r["full16_bytes"] / r["peak_bytes"])
    full = [r for r in res.records if r["method"] == "full"]
    assert all(r["ratio16"] == pytest.approx(0.5) for r in full)  # fp32 model: twice a 16-bit cache
    assert all(r["peak_bytes"] > r["measured_bytes"] for r in full)  # it grows with the question and answer
    # Records are saved after every example; plans are summarised per (method, budget, length).
    saved = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(saved) == len(res.records)
    assert any(k.startswith("2d_hetero|4x|") for k in res.plans)
    assert model.config._attn_implementation == "sdpa"  # restored after the run


def test_resume_skips_done_examples(model, table, tmp_path):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=2, budgets=("8x",), methods=("full", "2d_hetero"),
                     settings=("query_aware",), max_new_tokens=4)
    first = Runner(model, TOK, table, cfg, progress=False).run(tmp_path)
    runner = Runner(model, TOK, table, cfg, progress=False)
    runner.run_example = lambda ex, only=None: pytest.fail("a done example was run again")
    second = runner.run(tmp_path)
    assert second.records == first.records


def test_records_name_their_seed_and_run_and_another_seed_does_not_resume_them(model, table, tmp_path):
    """Seeds 0 and 1 draw different examples under the same indices: resuming seed 1 into seed 0's records would
    skip its examples as done (and a pooled report would pair the wrong ones)."""
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("8x",), methods=("full",),
                     settings=("query_aware",), max_new_tokens=4, seed=5)
    first = Runner(model, TOK, table, cfg, progress=False).run(tmp_path)
    assert [r["seed"] for r in first.records] == [5]
    # ... and their invocation, which the meta names with the CPU it ran on
    assert [r["run"] for r in first.records] == [first.meta["run"]] and first.meta["cpu"]
    before = (tmp_path / "records.jsonl").read_text()
    other = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("8x",), methods=("full",),
                       settings=("query_aware",), max_new_tokens=4, seed=6)
    with pytest.raises(MoendError, match="holds records of seed 5, not --seed 6.*moend report"):
        Runner(model, TOK, table, other, progress=False).run(tmp_path)
    assert (tmp_path / "records.jsonl").read_text() == before


@pytest.mark.parametrize("line, match", [('{"task": "passkey"', "is not a JSON record"),
                                         ('{"task": "passkey", "index": 0}', "lacks target_length, setting"),
                                         ("[1, 2]", "lacks task")])
def test_a_damaged_records_file_is_a_clear_error_and_is_left_as_it_was(model, table, tmp_path, line, match):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("8x",), methods=("full",),
                     settings=("query_aware",), max_new_tokens=4)
    path = tmp_path / "records.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(MoendError, match=f"records.jsonl:1 {match}"):
        Runner(model, TOK, table, cfg, progress=False).run(tmp_path)
    assert path.read_text() == line + "\n"


def test_resume_with_a_new_budget_runs_only_the_missing_runs(model, table, tmp_path):
    """Extending a finished run with a budget must not skip its done examples (they lack the new budget's
    records), nor run their done methods again."""
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=2, budgets=("8x",), methods=("full", "2d_hetero"),
                     settings=("query_aware",), max_new_tokens=4)
    first = Runner(model, TOK, table, cfg, progress=False).run(tmp_path)
    wider = EvalConfig(tasks=("passkey",), lengths=(300,), n=2, budgets=("8x", "14x"),
                       methods=("full", "2d_hetero"), settings=("query_aware",), max_new_tokens=4)
    asked: list[set] = []
    runner = Runner(model, TOK, table, wider, progress=False)
    inner = runner.run_example
    runner.run_example = lambda ex, only=None: asked.append(only) or inner(ex, only=only)
    second = runner.run(tmp_path)
    assert asked == [{("query_aware", "2d_hetero", "14x")}] * 2
    assert second.records[:len(first.records)] == first.records
    new = second.records[len(first.records):]
    assert [(r["index"], r["method"], r["budget"]) for r in new] == [(0, "2d_hetero", "14x"), (1, "2d_hetero", "14x")]
    # a third run finds every run done
    third = Runner(model, TOK, table, wider, progress=False)
    third.run_example = lambda ex, only=None: pytest.fail("a done run was run again")
    assert third.run(tmp_path).records == second.records


# ------------------------------------------------------------------------------------------------ exactness


def test_full_method_equals_plain_generate(model, table, example):
    ctx, suffix = _ids(example, "query_agnostic")
    model.set_attn_implementation(EVAL_ATTN)
    try:
        state = prefill(model, ctx)
        cache = build_cache(METHODS["full"], state, model=model)
        ours, why = greedy_decode(model, cache, suffix, 10)
        lossless = build_cache(METHODS["lossless"], state, model=model, plan=lossless_plan(table, state.length))
        ours_lossless, _ = greedy_decode(model, lossless, suffix, 10)
    finally:
        model.set_attn_implementation("sdpa")
    assert why == "max_new_tokens"
    ids = torch.tensor([ctx + suffix])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert ours == ref
    assert ours_lossless == ref


@pytest.mark.parametrize("method", [m for m in MOEND_METHODS if m != "lossless"])
@pytest.mark.parametrize("budget", ["3x", "6x", "10x"])
def test_measured_bytes_equal_memory_model(model, table, example, method, budget):
    ctx, _ = _ids(example, "query_aware")
    state = prefill(model, ctx)
    entry = PlanBook(table).get(method, budget, state.length)
    if entry.plan is None:
        assert entry.infeasible and "below the minimum" in entry.infeasible
        return
    from moend_fx.eviction.rope import rope_from_model

    stats = [table.layer_stats(i) for i in range(table.num_layers)]
    cache = build_cache(METHODS[method], state, model=model, plan=entry.plan, rope=rope_from_model(model),
                        query_stats=stats)
    # byte-exact, not estimated: what the cache holds is what the memory model says it holds; in capacity mode
    # (the default) it holds at most the plan's bytes at the prompt's length, which the plan was solved for,
    # and leaves room in them for the tokens the decode adds
    assert cache_nbytes(cache) == cache.model_bytes().total
    assert cache.budget_bytes().total == plan_bytes(entry.plan, state.length) <= entry.budget_bytes
    assert cache_nbytes(cache) <= plan_bytes(entry.plan, state.length)
    floor = keep_floor(entry.plan)  # sinks + recent window: short prompts keep at least these
    want = [keep_count(state.length, c.keep_ratio, floor) for c in entry.plan.layers]
    assert all(h <= w for h, w in zip(cache.held_tokens(), want))


def test_state_is_not_modified_by_methods(model, table, example):
    ctx, suffix = _ids(example, "query_aware")
    state = prefill(model, ctx)
    before = [(k.clone(), v.clone()) for k, v in state.kv]
    for name in ("full", "hf_fp8", "2d_hetero"):
        plan = PlanBook(table).get(name, "4x", state.length).plan if METHODS[name].kind == "moend" else None
        from moend_fx.eviction.rope import rope_from_model

        cache = build_cache(METHODS[name], state, model=model, plan=plan, rope=rope_from_model(model))
        model.set_attn_implementation(EVAL_ATTN)
        try:
            greedy_decode(model, cache, suffix, 3)
        finally:
            model.set_attn_implementation("sdpa")
    for (k, v), (k0, v0) in zip(state.kv, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_hf_fp8_bytes_are_one_byte_per_value(model, example):
    state = prefill(model, _ids(example, "query_aware")[0])
    cache = build_cache(METHODS["hf_fp8"], state, model=model)
    values = sum(k.numel() + v.numel() for k, v in state.kv)
    scales = 2 * len(state.kv) * 4  # one fp32 scale per K and V per layer
    assert cache_nbytes(cache) == values + scales


def test_prefill_in_two_chunks_matches_one(model, example):
    ctx, _ = _ids(example, "query_aware")
    one = prefill(model, ctx, window=16)
    two = prefill(model, ctx[-10:], window=16, base=prefill(model, ctx[:-10], window=16))
    assert two.length == one.length
    for (k1, v1), (k2, v2), q1, q2 in zip(one.kv, two.kv, one.queries, two.queries):
        # SDPA over a chunk vs the whole prompt: same maths, different reduction order (fp32 rounding).
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)
        assert q2.shape == q1.shape == (1, 4, 16, 32)
        torch.testing.assert_close(q2, q1, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ pieces


def test_query_recorder_keeps_last_window():
    rec = QueryRecorder(1, window=5)
    a = torch.arange(1, 4, dtype=torch.float32).view(1, 1, 3, 1)
    b = torch.arange(4, 8, dtype=torch.float32).view(1, 1, 4, 1)
    rec.record(0, a)
    rec.record(0, b)
    assert rec.q[0].flatten().tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("text, want", [
    (" 12345.", "answers"), (" 1234", None), ("\n\n 12", None), (" no idea\n", "newline"), ("", None),
])
def test_stop_reason(text, want):
    ex = Example("passkey", "intro", "context 12345", "q?", "The pass key is", answers=("12345",))
    assert stop_reason(ex, text) == want


def test_bad_config_raises():
    with pytest.raises(MoendError, match="task 'nope' is unknown"):
        EvalConfig(tasks=("nope",))
    with pytest.raises(MoendError, match="method 'h2o' is unknown"):
        EvalConfig(methods=("h2o",))
    with pytest.raises(MoendError, match="setting"):
        EvalConfig(settings=("sometimes",))
    with pytest.raises(MoendError, match="n=0"):
        EvalConfig(n=0)
    with pytest.raises(MoendError, match="budgets is empty"):
        EvalConfig(budgets=())


def test_a_length_past_the_models_context_is_refused_before_any_prefill(table):
    short = tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=1,
                       max_position_embeddings=512)
    cfg = EvalConfig(tasks=("passkey",), lengths=(500,), n=1, max_new_tokens=24)
    with pytest.raises(MoendError, match=r"500 \+ max_new_tokens 24 = 524 tokens exceeds this model's context of "
                                         r"512 .*allowed lengths: <= 488"):
        Runner(short, TOK, table, cfg, progress=False)
    Runner(short, TOK, table, EvalConfig(tasks=("passkey",), lengths=(488,), n=1, max_new_tokens=24),
           progress=False)  # at the limit: accepted


def test_scorer_override_uses_the_query_window(model, table):
    cfg = EvalConfig(tasks=("passkey",), lengths=(400,), n=1, budgets=("4x",), methods=("2d_hetero",),
                     max_new_tokens=3, scorer="snapkv")
    runner = Runner(model, TOK, table, cfg, progress=False)
    res = runner.run()
    assert res.meta["scorer"] == "snapkv" and len(res.records) == 2
    assert all(r["measured_bytes"] <= r["budget_bytes"] for r in res.records)
    with pytest.raises(MoendError, match="scorer 'nope' is unknown"):
        EvalConfig(scorer="nope")


def test_bad_budget_fails_before_running(model, table):
    with pytest.raises(MoendError, match="does not parse"):
        Runner(model, TOK, table, EvalConfig(budgets=("lots",)), progress=False)


def test_table_for_another_model_is_refused(table):
    other = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(MoendError, match="num_layers"):
        Runner(other, TOK, table, EvalConfig(), progress=False)


def test_cli_registers_eval_and_rejects_bad_lengths(tmp_path):
    from moend_fx.cli import build_parser, main

    args = build_parser().parse_args(["eval", "--out", str(tmp_path), "--tasks", "passkey,niah_single",
                                      "--lengths", "2048,4096", "--budgets", "4x,14x"])
    assert args.tasks == ("passkey", "niah_single") and args.lengths == (2048, 4096)
    with pytest.raises(SystemExit) as e:  # argparse reports a bad type itself: exit code 2, one line
        main(["eval", "--out", str(tmp_path), "--lengths", "2k"])
    assert e.value.code == 2
    assert main(["eval", "--out", str(tmp_path), "--table", str(tmp_path / "none.safetensors")]) == 2


# ------------------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def real_passkey_records():
    from moend_fx.models import load_model

    model, tok = load_model("smollm2-135m")
    fp = ModelFingerprint.from_model(model)
    grid = Grid()
    # The lossless plan reads no sensitivities: a placeholder table (all ones) carries the fingerprint.
    table = SensitivityTable(np.ones((fp.num_layers, len(grid))), grid, fp)
    # n = 4: this checks the runner's path (one prefill, a compressed copy per method, records); the lossless
    # plan's tokens are checked against DynamicCache on more prompts in tests/cache and tests/models (suite time:
    # 10 examples took ~160 s here, most of it prefills)
    cfg = EvalConfig(tasks=("passkey",), lengths=(2048,), n=4, methods=("full", "lossless"),
                     settings=("query_aware",), max_new_tokens=12)
    res = Runner(model, tok, table, cfg, progress=False).run()
    return {m: [r for r in res.records if r["method"] == m] for m in ("full", "lossless")}


@pytest.mark.slow
def test_real_model_lossless_moend_matches_full_cache(real_passkey_records):
    by = real_passkey_records
    assert [r["generated"] for r in by["lossless"]] == [r["generated"] for r in by["full"]]
    assert [r["score"] for r in by["lossless"]] == [r["score"] for r in by["full"]]


@pytest.mark.slow
def test_real_model_full_cache_passkey_accuracy_at_2k(real_passkey_records):
    full = real_passkey_records["full"]
    acc = sum(r["score"] for r in full) / len(full)
    # Issue 5's bar. With the one-sentence needle plain model.generate scored 29/30 on these prompts (the
    # classic needle's reversed repeat made the model answer "the pass key" on 5/30); a prompt, position or
    # mask bug drops accuracy to ~0.
    assert acc >= 0.9, [(r["answers"], r["generated"]) for r in full]


@pytest.mark.parametrize("n", [1, 2, 5, 10, 20])
def test_examples_run_in_an_order_whose_prefixes_spread_over_the_depths(n):
    from moend_fx.eval.runner import spread_order

    order = spread_order(n)
    assert sorted(order) == list(range(n))
    assert order[:2] == [0, n - 1][:n]
    for k in range(2, n + 1):  # no gap between the first k indices wider than twice the even spacing (+ rounding)
        seen = sorted(order[:k])
        assert max(b - a for a, b in zip(seen, seen[1:])) <= 2 * (n - 1) / (k - 1) + 1
