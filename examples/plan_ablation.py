"""Which part of a MoE-nD plan costs accuracy: the greedy plan against variants of itself on the same examples.

    python examples/plan_ablation.py --task niah_single --length 2048 --setting query_aware --budget 14x \
        --variants base,k8v8,k16v16,keep1,k8v4,k4v8,no-k4,kernel=17 --out results/ablation

Each example is prefilled once at full precision (``moend_fx.eval.runner.example_contexts``, the evaluation's
protocol); every variant compresses a copy of that prefill and answers greedily. Variants of the default
table's greedy plan for the example's length:

* ``base``: the plan itself; ``kXvY``: the plan's keep ratios with K at X and V at Y bits on every layer
  (more bytes than the budget: a diagnosis, not a method); ``keep1``: the plan's bits, every token kept of the
  prompt (in capacity mode the layers then start evicting whole groups once the question and answer outgrow the
  plan's bytes); ``keep1-ratio``: the same with ``budget_mode="ratio"``, so nothing is ever evicted;
  ``ratio``: the plan itself with ``budget_mode="ratio"``: evicted at the prompt as ``base``, then nothing evicted
  while the answer prefix and the answer are fed (they add their bytes: over the budget, a diagnosis);
  ``reevict=tokens``: the plan itself, its layers making room during the question and answer by dropping their
  lowest-ranked tokens (survivors re-quantized) instead of whole packed groups (``reevict=groups``, the default);
  ``evict-every=N``: the plan itself, each layer leaving room for min(N, 32) tokens when it evicts (default 128:
  32), so ``evict-every=1`` holds the cap's tokens after the prompt and evicts at each token that does not fit;
* ``no-k4``: the greedy plan for the same budget on the table with every 4-bit-K config barred (S set to 10);
  ``k4-floor=R``: the same with only the 4-bit-K configs of keep ratio <= R barred (``no-k4`` is ``k4-floor=1``);
  both with the solvers' last-resort rule off, so only the bar applies; ``narrow-k-anywhere``: the greedy plan
  with that rule off (``narrow_k_min_keep=0``: 4-bit keys at any keep ratio, the default before the rule);
  ``last-resort-every-length``: the greedy plan with the rule at every context length (``narrow_k_max_context=0``;
  by default it covers plans for contexts up to 4096 tokens only, so at 8k this is the rule's plan and ``base``
  the plan without it); ``narrow-k-min-keep=R``: the greedy plan with the rule's keep ratio at R (default 0.5;
  1: 4-bit keys a last resort on every layer that evicts); ``pin=LAYER:CONFIG``: the greedy plan with that layer
  held at that config (``pin=7:keep0.5_k8_v4``); the two combine with ``+``;
* ``table=PATH``: the greedy plan for the same budget on another table of this model (a safetensors table file,
  e.g. one whose S was measured otherwise), the cache's scorer and statistics unchanged;
* ``kernel=N`` / ``pooling=P``: the plan with the scorer's pooling kernel / pooling (``pooling`` for trig only);
* ``trig-weight=W``: the query-aware scorer's trig weight; ``norm-weight=W`` / ``value-weight=W`` /
  ``diversity-weight=W``: the trig scorer's key-norm / value-norm / key-novelty weights (the query-aware scorer
  ``snapkv_trig`` passes its value and novelty weights to its trig part; it has no key-norm weight);
* ``head-reduce=mean|max`` / ``combine=sum|max``: the query-aware scorer's folding of a KV group's query heads
  in its SnapKV part and its joining of the SnapKV and trig scores (``SnapKVTrigScorer``);
* ``full``: the uncompressed cache (the evaluation's ``full`` method), so a screen reads its gap on its own
  examples;
* ``fakek4-post`` / ``fakek4-pre`` / ``fakek4-token``: the plan's keep ratios and V bits with K held at 16 bits
  but its prompt tokens put through a 4-bit round trip (:func:`fake_k4`): as the cache quantizes K (per channel
  over 32 held tokens, after RoPE; the control, which should answer as ``base``), before RoPE, or per token.
  A diagnosis of how K is quantized, not a method: the bytes are K16's, and the answer's own tokens stay 16-bit.

Records are written per example (``records.jsonl`` in --out, resumed), then ``ablation.md``: accuracy % per
variant with its 95% interval (Wilson, or bootstrap for fractional scores), the measured cache bytes, and how
many examples it answers better and worse than the first variant (paired on the same examples).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import setting_tables
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text
from moend_fx.common.options import HeadReduce, QuantMode, ReEviction, ScoreCombine
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import METHODS, build_cache, cache_nbytes
from moend_fx.eval.runner import Runner, example_contexts, load_records
from moend_fx.eval.stats import summarize
from moend_fx.eval.steps import EVAL_ATTN, decode, greedy_decode, stop_reason
from moend_fx.eval.tasks.registry import make_examples, score
from moend_fx.eviction.rope import RopeSpec, apply_rope, invert_rope, rope_from_model
from moend_fx.models import load_model
from moend_fx.plan.config import LayerConfig
from moend_fx.plan.memory import split_packed
from moend_fx.plan.routing import RoutingPlan
from moend_fx.solvers import get_solver
from moend_fx.solvers.last_resort import NARROW_K_MAX_CONTEXT, NARROW_K_MIN_KEEP, last_resort_columns, rule_min_keep
from moend_fx.storage.packed import PackedKV
from moend_fx.storage.quant import dequantize, quantize

BARRED_S = 10.0  # far above any measured S (relative errors are <= ~1): the greedy never picks a barred config
FAKE_K4 = ("fakek4-post", "fakek4-pre", "fakek4-token")
# scorer options a variant may set: the query-aware scorer's trig weight, the trig scorer's weights
SCORER_WEIGHTS = {"trig-weight": "trig_weight", "norm-weight": "norm_weight", "value-weight": "value_weight",
                  "diversity-weight": "diversity_weight"}
# scorer options a variant may set by name: the query-aware scorer's head folding and score joining
SCORER_CHOICES = {"head-reduce": ("head_reduce", HeadReduce), "combine": ("combine", ScoreCombine)}
SCORER_OPTIONS = (*SCORER_WEIGHTS, *SCORER_CHOICES, "kernel", "pooling")
PLAN_OPTIONS = ("narrow-k-min-keep", "pin")  # solve options that combine with "+" (see variant_plan)
CACHE_OPTIONS = ("reevict", "evict-every")  # cache options that combine with "+" (see cache_kwargs)
ALLOWED = ("base, full, keep1, keep1-ratio, ratio, no-k4, narrow-k-anywhere, last-resort-every-length, "
           "reevict=groups|tokens, evict-every=N (>= 1), "
           "k4-floor=R (0 < R <= 1), narrow-k-min-keep=R (0 <= R <= 1), pin=LAYER:CONFIG, table=PATH, "
           "kXvY (X, Y in 2, 4, 8, 16), kernel=N (odd), pooling=max|avg|none, "
           + ", ".join(f"{w}=W (>= 0)" for w in SCORER_WEIGHTS) + ", "
           + ", ".join(f"{c}={'|'.join(e)}" for c, (_, e) in SCORER_CHOICES.items()) + ", " + ", ".join(FAKE_K4))


def check_variant(variant: str) -> str:
    """``variant`` if it names a variant this script knows (before any model is loaded), else a MoendError.

    Scorer options combine with ``+`` (``value-weight=1+pooling=avg``), as do plan options
    (``narrow-k-min-keep=1+pin=7:keep0.5_k8_v4``) and cache options (``evict-every=1+reevict=tokens``)."""
    if "+" in variant:
        parts = variant.split("+")
        names = [p.partition("=")[0] for p in parts]
        if any(all(n in group for n in names) for group in (SCORER_OPTIONS, PLAN_OPTIONS, CACHE_OPTIONS)):
            for p in parts:
                check_variant(p)
            return variant
        raise MoendError(f"variant {variant!r}: only scorer options, only narrow-k-min-keep and pin, or only "
                         f"reevict and evict-every combine with '+'; allowed: {ALLOWED}")
    name, _, value = variant.partition("=")
    try:
        if variant in ("base", "full", "keep1", "keep1-ratio", "ratio", "no-k4", "narrow-k-anywhere",
                       "last-resort-every-length", *FAKE_K4):
            return variant
        if name == "kernel" and int(value) % 2 == 1 and int(value) > 0:
            return variant
        if name == "k4-floor" and 0 < float(value) <= 1:
            return variant
        if name == "narrow-k-min-keep" and 0 <= float(value) <= 1:
            return variant
        if name == "pin" and ":" in value and int(value.partition(":")[0]) >= 0:
            LayerConfig.from_name(value.partition(":")[2], where=f"variant {variant!r}")
            return variant
        if name == "reevict" and value in list(ReEviction):
            return variant
        if name == "evict-every" and int(value) >= 1:
            return variant
        if name == "table" and Path(value).is_file():
            return variant
        if name in SCORER_WEIGHTS and float(value) >= 0:
            return variant
        if name == "pooling" and value in ("max", "avg", "none"):
            return variant
        if name in SCORER_CHOICES and value in list(SCORER_CHOICES[name][1]):
            return variant
        if not value and variant.startswith("k") and "v" in variant:
            if {int(x) for x in variant[1:].split("v")} <= {2, 4, 8, 16} and variant.count("v") == 1:
                return variant
    except ValueError:
        pass
    raise MoendError(f"variant {variant!r} is unknown; allowed: {ALLOWED}")


def solved_with(table: Any, budget: str, context_length: int, variant: str) -> RoutingPlan:
    """The greedy plan for ``budget`` under plan options joined by ``+``: ``narrow-k-min-keep=R`` (the
    last-resort rule's keep ratio) and ``pin=LAYER:CONFIG`` (that layer held at that config: every other config
    of the layer barred), e.g. ``narrow-k-min-keep=1+pin=7:keep0.5_k8_v4``. A pin the budget cannot keep is a
    MoendError, not a silently different plan."""
    options: dict[str, Any] = {}
    S = table.S.copy()
    pins = []
    for part in variant.split("+"):
        name, _, value = part.partition("=")
        if name == "narrow-k-min-keep":
            options["narrow_k_min_keep"] = float(value)
        else:
            layer, _, config = value.partition(":")
            if int(layer) >= S.shape[0]:
                raise MoendError(f"variant {variant!r}: layer {layer} is not allowed; allowed: 0..{S.shape[0] - 1}")
            pin = LayerConfig.from_name(config, where=f"variant {variant!r}")
            if pin not in table.grid.configs:
                raise MoendError(f"variant {variant!r}: {pin.name} is not in the table's grid; allowed: "
                                 f"{table.grid.describe()}")
            S[int(layer), [j for j, c in enumerate(table.grid.configs) if c != pin]] = BARRED_S
            pins.append((int(layer), pin))
    rule_keep = rule_min_keep(options.get("narrow_k_min_keep", NARROW_K_MIN_KEEP), NARROW_K_MAX_CONTEXT,
                              context_length)
    for _, pin in pins:
        if last_resort_columns(table.grid, rule_keep)[table.grid.configs.index(pin)]:
            raise MoendError(f"variant {variant!r}: {pin.name} has narrow keys below keep {rule_keep:g}, a last "
                             f"resort the solver takes only when nothing else fits; add narrow-k-min-keep="
                             f"{pin.keep_ratio:g} (or 0) to pin it")
    solved = get_solver("greedy", **options).solve(dataclasses.replace(table, S=S), budget,
                                                   context_length=context_length).plan
    for layer, pin in pins:
        if solved.layers[layer] != pin:
            raise MoendError(f"variant {variant!r}: the {budget} budget cannot hold layer {layer} at {pin.name}")
    return solved


def variant_plan(plan: RoutingPlan, variant: str, table: Any, budget: str) -> RoutingPlan:
    """The plan a variant compresses with (see the module docstring)."""
    if variant == "no-k4" or variant.startswith("k4-floor="):
        floor = 1.0 if variant == "no-k4" else float(variant.partition("=")[2])
        S = table.S.copy()
        for j, c in enumerate(table.grid.configs):
            if c.k_bits == 4 and c.keep_ratio <= floor:
                S[:, j] = BARRED_S
        barred = dataclasses.replace(table, S=S)
        return get_solver("greedy", narrow_k_min_keep=0.0).solve(barred, budget,
                                                                 context_length=plan.context_length).plan
    if variant == "narrow-k-anywhere":
        return get_solver("greedy", narrow_k_min_keep=0.0).solve(table, budget,
                                                                 context_length=plan.context_length).plan
    if variant.partition("=")[0] in PLAN_OPTIONS:
        return solved_with(table, budget, plan.context_length, variant)
    if variant == "last-resort-every-length":
        return get_solver("greedy", narrow_k_max_context=0).solve(table, budget,
                                                                 context_length=plan.context_length).plan
    if variant.startswith("table="):
        other = SensitivityTable.load(variant.partition("=")[2])
        other.check_model(table.fingerprint)
        return get_solver("greedy").solve(other, budget, context_length=plan.context_length).plan
    if variant in FAKE_K4:
        return dataclasses.replace(plan, layers=tuple(LayerConfig(c.keep_ratio, 16, c.v_bits) for c in plan.layers))
    if variant in ("keep1", "keep1-ratio"):
        return dataclasses.replace(plan, layers=tuple(LayerConfig(1.0, c.k_bits, c.v_bits) for c in plan.layers))
    if variant.startswith("k") and "v" in variant:
        k, v = (int(x) for x in variant[1:].split("v"))
        return dataclasses.replace(plan, layers=tuple(LayerConfig(c.keep_ratio, k, v) for c in plan.layers))
    return plan


def fake_k4(k: torch.Tensor, positions: torch.Tensor, where: str, rope: RopeSpec, group_size: int = GROUP_SIZE,
            ) -> torch.Tensor:
    """k: [B, H, n, D] post-RoPE keys held in this order at ``positions`` [B, H, n], with the tokens a 4-bit K
    layer would pack (the first multiple of ``group_size``) replaced by their 4-bit round trip (from the 16-bit
    copy, as the cache quantizes): ``post`` per channel over ``group_size`` held tokens, ``pre`` the same on the
    un-rotated keys (then rotated back), ``token`` per token over ``group_size`` channels."""
    p, _ = split_packed(k.shape[2], LayerConfig(0.5, 4, 16), group_size)
    if not p:
        return k
    x, pos = k[:, :, :p].to(torch.float16).float(), positions[:, :, :p]
    if where == "pre":
        x = invert_rope(x, pos, rope)
    mode = QuantMode.TOKEN if where == "token" else QuantMode.CHANNEL
    x = dequantize(quantize(x, 4, group_size, mode), torch.float32)
    if where == "pre":
        x = apply_rope(x, pos, rope)
    return torch.cat([x.to(k.dtype), k[:, :, p:]], dim=2)


@contextlib.contextmanager
def faked_keys(variant: str, rope: RopeSpec) -> Iterator[None]:
    """While open, a 16-bit-K layer that evicts packs K through :func:`fake_k4` whenever it compresses from dense
    K/V (the prompt, a capacity-mode eviction); ``variant`` one of FAKE_K4, any other leaves the cache alone."""
    if variant not in FAKE_K4:
        yield
        return
    where, original = variant.split("-")[1], PackedKV.__dict__["from_dense"]

    def from_dense(cls, k, v, config, group_size=GROUP_SIZE, positions=None, valid=None):  # type: ignore[no-untyped-def]
        if config.k_bits == 16 and positions is not None:
            k = fake_k4(k, positions, where, rope, group_size)
        return original.__func__(cls, k, v, config, group_size, positions, valid)

    PackedKV.from_dense = classmethod(from_dense)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        PackedKV.from_dense = original  # type: ignore[method-assign]


def scorer_kwargs(variant: str) -> dict[str, Any]:
    """Scorer options of a ``kernel=N`` / ``pooling=P`` / ``<weight>=W`` variant (none for the others)."""
    if "+" in variant:
        return {k: v for p in variant.split("+") for k, v in scorer_kwargs(p).items()}
    name, _, value = variant.partition("=")
    if name == "kernel":
        return {"kernel_size": int(value)}
    if name == "pooling":
        return {"pooling": value}
    if name in SCORER_WEIGHTS:
        return {SCORER_WEIGHTS[name]: float(value)}
    if name in SCORER_CHOICES:
        return {SCORER_CHOICES[name][0]: value}
    return {}


def cache_kwargs(variant: str) -> dict[str, Any]:
    """The cache options a variant changes: ``budget_mode`` for ``ratio`` / ``keep1-ratio``, ``reevict`` for
    ``reevict=groups|tokens`` (what a decode-time re-eviction drops), ``evict_every`` for ``evict-every=N`` (in
    capacity mode a layer leaves room for min(N, 32) tokens when it evicts, after the prompt too; none for the
    others)."""
    if "+" in variant:
        return {k: v for p in variant.split("+") for k, v in cache_kwargs(p).items()}
    name, _, value = variant.partition("=")
    if variant in ("keep1-ratio", "ratio"):
        return {"budget_mode": "ratio"}
    if name == "reevict":
        return {"reevict": value}
    if name == "evict-every":
        return {"evict_every": int(value)}
    return {}


def variant_kwargs(moend_kw: dict[str, Any], variant: str) -> dict[str, Any]:
    """The MoENDCache options of ``variant``: the evaluation's ``moend_kw`` with the variant's scorer options
    (:func:`scorer_kwargs`) and cache options (:func:`cache_kwargs`)."""
    return {**moend_kw, "scorer_kwargs": scorer_kwargs(variant), **cache_kwargs(variant)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def report_lines(records: list[dict[str, Any]], variants: list[str], title: str) -> list[str]:
    """ablation.md: per variant its accuracy with the 95% interval, the measured bytes, and, paired with the
    first variant on the examples both answered, how many examples it answers better and worse (the count the
    screens' decision rule reads)."""
    first = {r["index"]: r["score"] for r in records if r["variant"] == variants[0]}
    lines = [f"{title}: accuracy % [95% interval]; better / worse: examples scored higher / lower than "
             f"{variants[0]} on the same example", "",
             "| variant | n | accuracy | measured cache (mean) | better / worse |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for v in variants:
        rs = [r for r in records if r["variant"] == v]
        if not rs:
            continue
        sm = summarize([r["score"] for r in rs])
        mb = sum(r["measured_bytes"] for r in rs) / len(rs) / 1e6
        ci = f"[{100 * sm.low:.0f}, {100 * sm.high:.0f}]"
        paired = [(r["score"], first[r["index"]]) for r in rs if r["index"] in first]
        vs = "" if v == variants[0] else (f"{sum(a > b for a, b in paired)} / {sum(a < b for a, b in paired)}"
                                          f" of {len(paired)}")
        lines.append(f"| {v} | {len(rs)} | {100 * sm.mean:.1f} {ci} | {mb:.2f} MB | {vs} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0,
                    help="examples' seed (default 0: the published evaluation's examples; another seed gives "
                         "held-out ones)")
    ap.add_argument("--setting", default="query_aware", choices=["query_aware", "query_agnostic"])
    ap.add_argument("--budget", default="14x")
    ap.add_argument("--variants", default="base,k8v8,k16v16,keep1,k8v4,k4v8,no-k4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The evaluation's configuration for one screen: its task, length, n, seed, budget and setting."""
    return EvalConfig(tasks=(args.task,), lengths=(args.length,), n=args.n, budgets=(args.budget,),
                      methods=("2d_hetero",), settings=(args.setting,), seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [check_variant(v) for v in args.variants.split(",") if v]
    cfg = eval_config(args)
    tables, _, _ = setting_tables("smollm2-135m", cfg.settings, None)
    model, tok = load_model("smollm2-135m")
    runner = Runner(model, tok, tables, cfg, progress=False)
    setting_plans = runner.by_setting[cfg.settings[0]]
    rope = rope_from_model(model)
    model.set_attn_implementation(EVAL_ATTN)
    path = Path(args.out) / "records.jsonl"
    records = load_records(path, ("index", "variant")) if path.is_file() else []
    done = {(r["index"], r["variant"]) for r in records}
    spec = METHODS["2d_hetero"]
    for i, ex in enumerate(make_examples(args.task, tok, args.length, args.n, seed=cfg.seed)):
        todo = [v for v in variants if (i, v) not in done]
        if not todo:
            continue
        for _, state, suffix, _ in example_contexts(model, tok, ex, [cfg.settings[0]], window=cfg.window):
            plan = setting_plans.plans.get(spec.name, args.budget, state.length).plan
            for v in todo:
                kw = variant_kwargs(setting_plans.moend_kw, v)
                with faked_keys(v, rope):
                    if v == "full":
                        cache = build_cache(METHODS["full"], state, model=model)
                    else:
                        cache = build_cache(spec, state, model=model,
                                            plan=variant_plan(plan, v, setting_plans.table, args.budget), **kw)
                    measured = cache_nbytes(cache)
                    new, _ = greedy_decode(model, cache, suffix, cfg.max_new(len(ex.answers)), tokenizer=tok,
                                           stop=lambda s, ex=ex: stop_reason(ex, s))
                text = decode(tok, new)
                records.append(dict(index=i, variant=v, generated=text, score=score(ex, text),
                                    measured_bytes=measured, answers=list(ex.answers)))
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        print(f"example {i + 1}/{args.n}: " + ", ".join(
            f"{v} {100 * _mean([r['score'] for r in records if r['variant'] == v and r['index'] <= i]):.1f}%"
            for v in variants), file=sys.stderr, flush=True)
    seed = "" if cfg.seed == 0 else f", examples of seed {cfg.seed}"
    lines = report_lines(records, variants,
                         f"{args.task} at {args.length} tokens, {args.setting}, {args.budget}{seed}")
    atomic_write_text(Path(args.out) / "ablation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
