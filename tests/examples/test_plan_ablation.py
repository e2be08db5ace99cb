"""examples/plan_ablation.py: the plan variants it compresses with (on a synthetic table; no model)."""

from __future__ import annotations

import pytest
import torch

from moend_fx.calibration.tables import load_table
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import plan_bytes
from moend_fx.solvers import get_solver
from tests.examples.helpers import load_example


@pytest.fixture(scope="module")
def ablation():
    return load_example("plan_ablation")


@pytest.fixture(scope="module")
def solved():
    table = load_table("synthetic:30:0")
    return table, get_solver("greedy").solve(table, "14x", context_length=2048).plan


def test_bit_and_keep_variants_change_only_what_they_name(ablation, solved):
    table, plan = solved
    assert ablation.variant_plan(plan, "base", table, "14x") is plan
    k8v4 = ablation.variant_plan(plan, "k8v4", table, "14x")
    assert [c.keep_ratio for c in k8v4.layers] == [c.keep_ratio for c in plan.layers]
    assert {(c.k_bits, c.v_bits) for c in k8v4.layers} == {(8, 4)}
    keep1 = ablation.variant_plan(plan, "keep1", table, "14x")
    assert {c.keep_ratio for c in keep1.layers} == {1.0}
    assert [(c.k_bits, c.v_bits) for c in keep1.layers] == [(c.k_bits, c.v_bits) for c in plan.layers]
    assert ablation.variant_plan(plan, "keep1-ratio", table, "14x") == keep1  # same plan; only the mode differs
    assert ablation.variant_plan(plan, "ratio", table, "14x") is plan


def test_no_k4_is_the_greedy_plan_without_4_bit_keys_within_the_same_budget(ablation, solved):
    table, plan = solved
    # the plan without the last-resort rule uses 4-bit keys, else the variant would test nothing
    assert any(c.k_bits == 4 for c in ablation.variant_plan(plan, "narrow-k-anywhere", table, "14x").layers)
    barred = ablation.variant_plan(plan, "no-k4", table, "14x")
    assert all(c.k_bits != 4 for c in barred.layers)
    assert barred.budget_bytes == plan.budget_bytes and plan_bytes(barred) <= barred.budget_bytes


def test_k4_floor_bars_4_bit_keys_only_at_and_below_its_keep_ratio(ablation, solved):
    table, plan = solved
    floor = ablation.variant_plan(plan, "k4-floor=0.25", table, "14x")
    assert all(c.k_bits != 4 for c in floor.layers if c.keep_ratio <= 0.25)
    # a floor below every keep ratio bars nothing: the greedy plan without the last-resort rule
    assert (ablation.variant_plan(plan, "k4-floor=0.05", table, "14x").layers
            == ablation.variant_plan(plan, "narrow-k-anywhere", table, "14x").layers)
    assert floor.budget_bytes == plan.budget_bytes and plan_bytes(floor) <= floor.budget_bytes
    assert ablation.variant_plan(plan, "k4-floor=1", table, "14x") == ablation.variant_plan(plan, "no-k4", table,
                                                                                             "14x")


def test_narrow_k_anywhere_is_the_greedy_plan_without_the_last_resort_rule(ablation, solved):
    table, plan = solved
    assert not any(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in plan.layers)  # the rule holds by default
    anywhere = ablation.variant_plan(plan, "narrow-k-anywhere", table, "14x")
    assert any(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in anywhere.layers)  # else this tests nothing
    assert anywhere.layers == get_solver("greedy", narrow_k_min_keep=0).solve(table, "14x",
                                                                              context_length=2048).plan.layers
    assert anywhere.budget_bytes == plan.budget_bytes and plan_bytes(anywhere) <= anywhere.budget_bytes


def test_narrow_k_min_keep_moves_the_last_resort_rules_keep_ratio(ablation):
    table = load_table("synthetic:30:0")
    plan = get_solver("greedy").solve(table, "10x", context_length=2048).plan
    assert any(c.k_bits <= 4 and c.keep_ratio < 1.0 for c in plan.layers)  # else this tests nothing
    evicting = ablation.variant_plan(plan, ablation.check_variant("narrow-k-min-keep=1"), table, "10x")
    assert not any(c.k_bits <= 4 and c.keep_ratio < 1.0 for c in evicting.layers)
    assert evicting.budget_bytes == plan.budget_bytes and plan_bytes(evicting) <= evicting.budget_bytes
    assert (ablation.variant_plan(plan, "narrow-k-min-keep=0", table, "10x").layers
            == ablation.variant_plan(plan, "narrow-k-anywhere", table, "10x").layers)
    with pytest.raises(MoendError, match=r"allowed: .*narrow-k-min-keep=R \(0 <= R <= 1\)"):
        ablation.check_variant("narrow-k-min-keep=1.5")


def test_pin_holds_a_layer_at_its_config_and_combines_with_the_rule(ablation):
    from moend_fx.plan.config import LayerConfig

    table = load_table("synthetic:30:0")
    plan = get_solver("greedy").solve(table, "10x", context_length=2048).plan
    assert plan.layers[7] != LayerConfig(0.5, 8, 4)  # else the pin tests nothing
    variant = ablation.check_variant("narrow-k-min-keep=1+pin=7:keep0.5_k8_v4")
    pinned = ablation.variant_plan(plan, variant, table, "10x")
    assert pinned.layers[7] == LayerConfig(0.5, 8, 4)
    assert not any(c.k_bits <= 4 and c.keep_ratio < 1.0 for c in pinned.layers)  # the rule still holds
    assert pinned.budget_bytes == plan.budget_bytes and plan_bytes(pinned) <= pinned.budget_bytes
    alone = ablation.variant_plan(plan, "pin=7:keep0.5_k8_v4", table, "10x")  # the default rule
    assert alone.layers[7] == LayerConfig(0.5, 8, 4) and plan_bytes(alone) <= alone.budget_bytes
    with pytest.raises(MoendError, match="cannot hold layer 7 at keep1_k16_v16"):
        ablation.variant_plan(plan, "pin=7:keep1_k16_v16+pin=8:keep1_k16_v16+pin=9:keep1_k16_v16+"
                              "pin=10:keep1_k16_v16", table, "16x")
    with pytest.raises(MoendError, match="keep0.25_k4_v4 has narrow keys below keep 0.5, a last resort .* add "
                       "narrow-k-min-keep=0.25"):
        ablation.variant_plan(plan, "pin=7:keep0.25_k4_v4", table, "10x")
    allowed = ablation.variant_plan(plan, "narrow-k-min-keep=0.25+pin=7:keep0.25_k4_v4", table, "10x")
    assert allowed.layers[7] == LayerConfig(0.25, 4, 4)
    with pytest.raises(MoendError, match="layer 30 is not allowed; allowed: 0..29"):
        ablation.variant_plan(plan, "pin=30:keep0.5_k8_v4", table, "10x")
    with pytest.raises(MoendError, match="only narrow-k-min-keep and pin"):
        ablation.check_variant("pin=7:keep0.5_k8_v4+k8v4")


def test_last_resort_every_length_is_the_rules_plan_past_its_max_context(ablation):
    table = load_table("synthetic:30:0")
    long = get_solver("greedy").solve(table, "16x", context_length=4097).plan  # past the rule's 4096 tokens
    narrow_low = lambda plan: sum(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in plan.layers)  # noqa: E731
    assert narrow_low(long) > 0  # else this tests nothing
    every = ablation.variant_plan(long, "last-resort-every-length", table, "16x")
    assert narrow_low(every) == 0 and plan_bytes(every) <= long.budget_bytes
    short = get_solver("greedy").solve(table, "16x", context_length=4096).plan
    assert ablation.variant_plan(short, "last-resort-every-length", table, "16x").layers == short.layers


def test_table_variant_solves_the_same_budget_on_the_other_table(ablation, solved, tmp_path):
    import dataclasses

    table, plan = solved
    S = table.S.copy()
    S[:, [j for j, c in enumerate(table.grid.configs) if c.k_bits == 4]] = 10.0
    path = tmp_path / "other.safetensors"
    dataclasses.replace(table, S=S).save(path)
    variant = ablation.check_variant(f"table={path}")
    other = ablation.variant_plan(plan, variant, table, "14x")
    assert other.layers == ablation.variant_plan(plan, "no-k4", table, "14x").layers
    with pytest.raises(MoendError, match="allowed: .*table=PATH"):
        ablation.check_variant(f"table={tmp_path / 'missing.safetensors'}")


def test_scorer_variants_parse_their_option(ablation):
    assert ablation.scorer_kwargs("kernel=17") == {"kernel_size": 17}
    assert ablation.scorer_kwargs("trig-weight=0.5") == {"trig_weight": 0.5}
    assert ablation.scorer_kwargs("k8v8") == {}
    assert ablation.scorer_kwargs("pooling=avg") == {"pooling": "avg"}
    assert ablation.scorer_kwargs("value-weight=1+norm-weight=0") == {"value_weight": 1.0, "norm_weight": 0.0}
    assert ablation.scorer_kwargs("diversity-weight=0.5") == {"diversity_weight": 0.5}
    assert ablation.scorer_kwargs("keep1-ratio") == {}
    assert ablation.scorer_kwargs("head-reduce=max+combine=max") == {"head_reduce": "max", "combine": "max"}
    assert ablation.scorer_kwargs("full") == {}


@pytest.mark.parametrize("bad", ["k8x4", "k3v4", "k8v4v2", "kernel=4", "kernel=x", "trig-weight=-1", "foo", "",
                                 "value-weight=-1", "diversity-weight=-1", "pooling=min", "k8v4+kernel=3",
                                 "value-weight=1+foo=2", "k4-floor=0", "k4-floor=1.5", "k4-floor=0.25+kernel=3",
                                 "head-reduce=sum", "combine=mean", "full+combine=max"])
def test_an_unknown_variant_is_a_clear_error_naming_the_allowed_ones(ablation, bad):
    with pytest.raises(MoendError, match="allowed: base, full, keep1, keep1-ratio, ratio, no-k4"):
        ablation.check_variant(bad)


@pytest.mark.parametrize("good", ["base", "keep1", "keep1-ratio", "ratio", "no-k4", "diversity-weight=0.5", "k8v4",
                                  "k16v16", "kernel=17", "trig-weight=0.5",
                                  "norm-weight=0", "value-weight=2", "pooling=none", "value-weight=1+pooling=avg",
                                  "k4-floor=0.25", "narrow-k-anywhere", "last-resort-every-length", "full",
                                  "head-reduce=max", "combine=max", "combine=sum+head-reduce=mean+trig-weight=0.5"])
def test_known_variants_pass(ablation, good):
    assert ablation.check_variant(good) == good


# --------------------------------------------------------------------------- fakek4-*: how K is quantized

D, G = 64, 32


def _keys(n: int, seed: int = 0):
    """Post-RoPE keys [1, 2, n, D] (random, with a few large channels as real keys have) at scattered ascending
    positions [1, 2, n]."""
    from moend_fx.eviction.rope import RopeSpec, apply_rope

    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(1, 2, n, D, generator=gen) * (1 + 4 * (torch.arange(D) % 13 == 0))
    pos = torch.sort(torch.randperm(4 * n, generator=gen)[:n]).values.expand(1, 2, n).contiguous()
    rope = RopeSpec.default(D)
    return apply_rope(pre, pos, rope), pre, pos, rope


@pytest.mark.parametrize("where,mode", [("post", "channel"), ("token", "token")])
def test_fake_k4_is_the_storage_round_trip_of_the_packed_tokens_only(ablation, where, mode):
    from moend_fx.storage.quant import dequantize, quantize

    k, _, pos, rope = _keys(70)
    out = ablation.fake_k4(k, pos, where, rope, G)
    want = dequantize(quantize(k[:, :, :64].half().float(), 4, G, mode), torch.float32)
    assert torch.equal(out[:, :, :64], want)  # the same ops on the same values: exact
    assert torch.equal(out[:, :, 64:], k[:, :, 64:])  # the 6 tokens a 4-bit layer keeps in its 16-bit window
    assert (out[:, :, :64] - k[:, :, :64]).abs().max() > 0.01  # 4 bits changed something


def test_fake_k4_pre_quantizes_before_rope(ablation):
    """Keys whose pre-RoPE values are the same at every position: before RoPE a channel's group has no range, so
    the round trip only rounds the zero to fp16 (relative 2^-11, plus float32 rotation error); after RoPE the
    tokens sit at unrelated angles and 4 bits lose about a step of 1/15 of the range."""
    k, pre, pos, rope = _keys(64)
    from moend_fx.eviction.rope import apply_rope

    const = apply_rope(pre[:, :, :1].expand_as(pre).contiguous(), pos, rope)
    scale = const.abs().max()
    pre_err = (ablation.fake_k4(const, pos, "pre", rope, G) - const).abs().max()
    post_err = (ablation.fake_k4(const, pos, "post", rope, G) - const).abs().max()
    assert pre_err < 2e-3 * scale < 0.1 * post_err


def test_faked_keys_swaps_the_16_bit_prompt_compression_and_restores_it(ablation):
    from moend_fx.plan.config import LayerConfig
    from moend_fx.storage.packed import PackedKV

    k, _, pos, rope = _keys(70, seed=1)
    v = torch.randn_like(k)
    config, original = LayerConfig(0.5, 16, 4), PackedKV.__dict__["from_dense"]
    with ablation.faked_keys("base", rope):
        assert PackedKV.__dict__["from_dense"] is original
    with ablation.faked_keys("fakek4-pre", rope):
        faked = PackedKV.from_dense(k, v, config, G, positions=pos)
    assert PackedKV.__dict__["from_dense"] is original
    with pytest.raises(RuntimeError), ablation.faked_keys("fakek4-post", rope):
        raise RuntimeError("a failed decode")
    assert PackedKV.__dict__["from_dense"] is original
    plain = PackedKV.from_dense(k, v, config, G, positions=pos)
    got = faked.dequantize(torch.float32)[0]
    assert torch.allclose(got, ablation.fake_k4(k, pos, "pre", rope, G).half().float())
    assert not torch.allclose(got, plain.dequantize(torch.float32)[0])
    assert torch.equal(faked.dequantize(torch.float32)[1], plain.dequantize(torch.float32)[1])  # V untouched


def test_fake_variants_hold_k_at_16_bits_and_keep_the_rest_of_the_plan(ablation, solved):
    table, plan = solved
    for v in ablation.FAKE_K4:
        assert ablation.check_variant(v) == v
        got = ablation.variant_plan(plan, v, table, "14x")
        assert [(c.keep_ratio, c.v_bits) for c in got.layers] == [(c.keep_ratio, c.v_bits) for c in plan.layers]
        assert {c.k_bits for c in got.layers} == {16}


def test_seed_selects_held_out_examples_and_defaults_to_the_evaluations(ablation):
    default = ablation.eval_config(ablation.parse_args(["--out", "x"]))
    held_out = ablation.eval_config(ablation.parse_args(["--out", "x", "--seed", "1", "--length", "4096"]))
    assert default.seed == 0 and held_out.seed == 1
    assert held_out.lengths == (4096,) and held_out.methods == ("2d_hetero",)


def test_reevict_variant_sets_only_the_caches_re_eviction(ablation, solved):
    table, plan = solved
    assert ablation.check_variant("reevict=tokens") == "reevict=tokens"
    assert ablation.cache_kwargs("reevict=tokens") == {"reevict": "tokens"}
    assert ablation.cache_kwargs("ratio") == {"budget_mode": "ratio"}
    assert ablation.cache_kwargs("k8v8") == {}
    assert ablation.check_variant("evict-every=1") == "evict-every=1"
    assert ablation.cache_kwargs("evict-every=1") == {"evict_every": 1}
    with pytest.raises(MoendError, match="allowed: .*evict-every=N"):
        ablation.check_variant("evict-every=0")
    both = ablation.check_variant("evict-every=1+reevict=tokens")
    assert ablation.cache_kwargs(both) == {"evict_every": 1, "reevict": "tokens"}
    assert ablation.variant_plan(plan, both, table, "10x") == plan
    assert ablation.variant_kwargs({"window": 32, "reevict": "groups"}, "kernel=17+pooling=avg") == {
        "window": 32, "reevict": "groups", "scorer_kwargs": {"kernel_size": 17, "pooling": "avg"}}
    assert ablation.variant_kwargs({"reevict": "groups"}, both) == {
        "reevict": "tokens", "evict_every": 1, "scorer_kwargs": {}}
    assert ablation.variant_plan(plan, "reevict=tokens", table, "10x") == plan
    with pytest.raises(MoendError, match="allowed: .*reevict=groups\\|tokens"):
        ablation.check_variant("reevict=bytes")


def test_report_pairs_each_variant_with_the_first_on_the_same_examples(ablation):
    def rec(i, v, s):
        return dict(index=i, variant=v, score=s, measured_bytes=2e6)

    records = [rec(0, "base", 1.0), rec(1, "base", 0.0), rec(2, "base", 1.0), rec(3, "base", 0.0),
               rec(0, "k8v8", 1.0), rec(1, "k8v8", 1.0), rec(2, "k8v8", 0.0), rec(3, "k8v8", 1.0),
               rec(9, "k8v8", 1.0)]  # example 9 has no base record: left out of the pairing, not of the accuracy
    lines = ablation.report_lines(records, ["base", "k8v8", "no-k4"], "passkey")
    assert lines[0].startswith("passkey: accuracy %") and "than base" in lines[0]
    rows = {line.split(" | ")[0][2:]: line for line in lines[4:]}
    assert set(rows) == {"base", "k8v8"}  # a variant without records gets no row
    assert rows["base"] == "| base | 4 | 50.0 [15, 85] | 2.00 MB |  |"
    assert rows["k8v8"].startswith("| k8v8 | 5 | 80.0 ") and rows["k8v8"].endswith("| 2 / 1 of 4 |")
