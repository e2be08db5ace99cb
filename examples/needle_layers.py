"""Which layers of a compressed cache still hold a needle's tokens, under MoE-nD's plan and variants of it.

    python examples/needle_layers.py --task niah_single --length 2048 --setting query_aware --seed 1 --index 14 \
        --budget 14x --variants base,narrow-k-min-keep=1

For one example of the evaluation (its task, length, seed and index), prefilled at full precision as the
evaluation does, each variant's cache (the variants of ``examples/plan_ablation.py``) compresses the prompt and
answers greedily. Printed per variant: the answer, then per layer its config and, for each token of the first
answer's occurrence in the prompt, how many KV heads still hold it after the answer was generated (``-``: a layer
that evicts nothing). A retrieval that fails while a layer that held the needle under another plan holds none of
it points at that layer (docs/results.md, "Narrow keys on every evicting layer").
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moend_fx.calibration.tables import setting_tables
from moend_fx.common.errors import MoendError
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import METHODS, build_cache
from moend_fx.eval.runner import Runner, example_contexts
from moend_fx.eval.steps import EVAL_ATTN, decode, encode, greedy_decode, stop_reason
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import load_model


def _ablation() -> Any:
    """examples/plan_ablation.py as a module: its variants and their plans."""
    spec = importlib.util.spec_from_file_location("plan_ablation", Path(__file__).with_name("plan_ablation.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def find_span(ids: Sequence[int], span: Sequence[int]) -> int:
    """The first index at which ``span`` occurs in ``ids``, else a MoendError (the needle is not in the prompt as
    those tokens, e.g. tokenized differently in context)."""
    n = len(span)
    for i in range(len(ids) - n + 1):
        if list(ids[i:i + n]) == list(span):
            return i
    raise MoendError(f"the answer's tokens {list(span)} do not occur in the prompt's tokens; "
                     "allowed: an example whose answer is tokenized the same in the prompt")


def heads_holding(positions: torch.Tensor | None, start: int, n: int) -> list[int] | None:
    """For each of the ``n`` token positions from ``start``: how many KV heads hold it.

    positions: [B, H, S] original positions a layer holds per KV head (batch 0 is read), or None for a layer
    that evicts nothing (then None)."""
    if positions is None:
        return None
    held = positions[0].long()
    return [int((held == start + j).any(dim=-1).sum()) for j in range(n)]


def layer_rows(cache: Any, plan: Any, start: int, n: int) -> list[str]:
    """``"layer:config:counts"`` per layer (counts as digits per needle token, ``-`` for a layer that holds all)."""
    rows = []
    for i, (layer, cfg) in enumerate(zip(cache.layers, plan.layers, strict=True)):
        counts = heads_holding(layer.packed.positions, start, n)
        rows.append(f"{i}:{cfg.name}:{'-' if counts is None else ''.join(str(c) for c in counts)}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--setting", default="query_aware", choices=["query_aware", "query_agnostic"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=30,
                    help="how many examples the seed draws (default 30, the evaluation's at 2k / 4k; 20 at 8k): the "
                         "needle depths spread over them, so an index names the same example only with the same n")
    ap.add_argument("--index", type=int, default=0, help="the example's index among the seed's n examples")
    ap.add_argument("--budget", default="14x")
    ap.add_argument("--variants", default="base,narrow-k-min-keep=1")
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ablation = _ablation()
    variants = [ablation.check_variant(v) for v in args.variants.split(",") if v]
    if "full" in variants:
        raise MoendError("variant 'full' holds every token on every layer: there is nothing per layer to show; "
                         "allowed: the other variants of examples/plan_ablation.py")
    if not 0 <= args.index < args.n:
        raise MoendError(f"--index {args.index} is not allowed; allowed: 0 <= index < --n ({args.n})")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EvalConfig(tasks=(args.task,), lengths=(args.length,), n=args.n, budgets=(args.budget,),
                     methods=("2d_hetero",), settings=(args.setting,), seed=args.seed)
    tables, _, _ = setting_tables("smollm2-135m", cfg.settings, None)
    model, tok = load_model("smollm2-135m")
    setting_plans = Runner(model, tok, tables, cfg, progress=False).by_setting[cfg.settings[0]]
    model.set_attn_implementation(EVAL_ATTN)
    ex = make_examples(args.task, tok, args.length, args.n, seed=args.seed)[args.index]
    needle = encode(tok, ex.answers[0])
    start = find_span(encode(tok, ex.prefill_text("query_agnostic"), special=True), needle)
    print(f"{args.task} at {args.length} tokens, {args.setting}, seed {args.seed}, example {args.index}: answer "
          f"{ex.answers[0]!r} = tokens {needle} at position {start}")
    spec, rope = METHODS["2d_hetero"], rope_from_model(model)
    for _, state, suffix, _ in example_contexts(model, tok, ex, cfg.settings, window=cfg.window):
        plan = setting_plans.plans.get(spec.name, args.budget, state.length).plan
        for v in variants:
            vplan = ablation.variant_plan(plan, v, setting_plans.table, args.budget)
            # a variant's scorer and cache options as plan_ablation.py sets them (not only its plan)
            kw = ablation.variant_kwargs(setting_plans.moend_kw, v)
            with ablation.faked_keys(v, rope):
                cache = build_cache(spec, state, model=model, plan=vplan, **kw)
                new, _ = greedy_decode(model, cache, suffix, cfg.max_new(len(ex.answers)), tokenizer=tok,
                                       stop=lambda s: stop_reason(ex, s))
            print(f"{v}: answered {decode(tok, new)!r}")
            print("  " + " ".join(layer_rows(cache, vplan, start, len(needle))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
