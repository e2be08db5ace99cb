"""``moend bench heads``: would per-KV-head token counts (Ada-KV) help MoE-nD's plans at the same bytes?

The cache stores every KV head of a layer with one token count (``docs/cache-format.md``), so a ragged layout is
only worth building if heads that share a layer's tokens by score (:mod:`moend_fx.eviction.head_budgets`) answer
better. This benchmark measures that on the evaluation's examples, before any such layout exists, with a
*simulated* cache, in three variants per (example, setting, budget), all from the same full-precision prefill and
the same plan (the setting's ``2d_hetero`` plan by default):

* ``moend``: the real :class:`~moend_fx.cache.moend_cache.MoENDCache` (what ``moend eval`` runs);
* ``uniform``: the simulation with every head keeping the layer's count (it should answer as ``moend`` does);
* ``ada``: the simulation with per-head counts (:func:`~moend_fx.eviction.head_budgets.head_counts`).

The simulation and its bytes: :mod:`moend_fx.bench.head_sim`; the report: :mod:`moend_fx.bench.head_report`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moend_fx.bench.head_sim import HEADSIM_ATTN, simulate, simulated
from moend_fx.common.checks import check_choice, check_int, check_names
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text
from moend_fx.common.options import Setting
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import METHODS, PrefillState, build_cache
from moend_fx.eval.runner import example_contexts, load_records
from moend_fx.eval.setting_plans import setting_plans
from moend_fx.eval.steps import decode, greedy_decode, stop_reason
from moend_fx.eval.tasks.registry import TASKS, Example, make_examples, score
from moend_fx.eviction.head_budgets import DEFAULT_ALPHA
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import RoutingPlan

VARIANTS = ("moend", "uniform", "ada")
_RUN_FIELDS = ("task", "index", "setting", "budget", "variant")


@dataclass(frozen=True)
class HeadBudgetSettings:
    """What ``moend bench heads`` runs: ``n`` examples of ``task`` at ``length`` tokens, each setting, each budget,
    the plan of ``method``; ``alpha``: the per-head floor share of :func:`head_counts`."""

    task: str = "niah_multivalue"
    length: int = 2048
    n: int = 30
    budgets: tuple[str, ...] = ("8x", "14x", "20x")
    settings: tuple[Setting, ...] = tuple(Setting)
    method: str = "2d_hetero"
    alpha: float = DEFAULT_ALPHA
    seed: int = 0

    def __post_init__(self) -> None:
        check_names("task", "task", (self.task,), TASKS)
        object.__setattr__(self, "budgets", tuple(self.budgets))
        object.__setattr__(self, "settings", tuple(check_choice("setting", s, Setting) for s in self.settings))
        if not self.budgets or not self.settings:
            raise MoendError("budgets and settings must each name at least one")
        if self.method not in METHODS or METHODS[self.method].kind != "moend" or not METHODS[self.method].budgeted:
            allowed = [m for m, s in METHODS.items() if s.kind == "moend" and s.budgeted]
            raise MoendError(f"method {self.method!r} has no budgeted MoENDCache plan; allowed: {', '.join(allowed)}")
        check_int("n", self.n)
        check_int("length", self.length, minimum=64)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise MoendError(f"alpha={self.alpha!r}; must be a number in [0, 1]")

    def eval_config(self) -> EvalConfig:
        return EvalConfig(tasks=(self.task,), lengths=(self.length,), n=self.n, budgets=self.budgets,
                          methods=(self.method,), settings=self.settings, seed=self.seed)


# --------------------------------------------------------------------------------------------- runs


class HeadBudgetBench:
    """Runs the three variants on every example (see the module docstring); records resume per run."""

    def __init__(self, model: Any, tokenizer: Any, tables: Any, settings: HeadBudgetSettings,
                 progress: bool = True) -> None:
        self.model, self.tokenizer, self.s, self.progress = model, tokenizer, settings, progress
        self.cfg = settings.eval_config()
        self.by_setting = setting_plans(model, tables, self.cfg)
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def examples(self) -> list[Example]:
        return make_examples(self.s.task, self.tokenizer, self.s.length, self.s.n, seed=self.s.seed)

    def run(self, out_dir: str | Path, resume: bool = True) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        path = Path(out_dir) / "records.jsonl"
        records = load_records(path, _RUN_FIELDS, "delete the file to start over") if resume and path.is_file() else []
        done = {tuple(r[k] for k in _RUN_FIELDS) for r in records}
        runs = [(str(st), b, v) for st in self.s.settings for b in self.s.budgets for v in VARIANTS]
        bar = tqdm(self.examples(), desc="heads", unit="ex", disable=not self.progress, dynamic_ncols=True)
        for ex in bar:
            key = (ex.task, ex.meta["index"])
            missing = {r for r in runs if key + r not in done}
            if not missing:
                continue
            for setting, state, suffix, _ in example_contexts(self.model, self.tokenizer, ex,
                                                              {r[0] for r in missing}, window=self.cfg.window):
                records += self._example(ex, setting, state, suffix, missing)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        return records

    def _example(self, ex: Example, setting: Setting, state: PrefillState, suffix: list[int],
                 missing: set[tuple[str, str, str]]) -> list[dict[str, Any]]:
        sp = self.by_setting[setting]
        full16 = full_cache_bytes(sp.table.fingerprint, state.length, dtype="16bit")
        max_new = self.cfg.max_new(len(ex.answers))
        kw = dict(tokenizer=self.tokenizer, stop=lambda s: stop_reason(ex, s), eos_token_id=self.eos)
        out = []
        for budget in self.s.budgets:
            entry = sp.plans.get(self.s.method, budget, state.length)
            todo = [v for v in VARIANTS if (str(setting), budget, v) in missing]
            base = dict(task=ex.task, index=ex.meta["index"], setting=str(setting), budget=budget,
                        method=self.s.method, context_tokens=state.length, answers=list(ex.answers))
            if entry.plan is None:
                out += [{**base, "variant": v, "infeasible": entry.infeasible, "score": None} for v in todo]
                continue
            t0 = time.perf_counter()
            cache = build_cache(METHODS[self.s.method], state, model=self.model, plan=entry.plan, **sp.moend_kw)
            held = cache.held_tokens()  # before decoding grows it
            real_bytes = cache.nbytes().total - cache.state_nbytes()  # storage: the simulation has no eviction state
            for variant in todo:
                if variant == "moend":
                    new, _ = greedy_decode(self.model, cache, suffix, max_new, **kw)
                    extra: dict[str, Any] = {"bytes": real_bytes}
                else:
                    new, extra = self._simulated(variant, entry.plan, state, suffix, held, sp.moend_kw, max_new, kw)
                text = decode(self.tokenizer, new)
                out.append({**base, "variant": variant, **extra, "ratio16": full16 / extra["bytes"],
                            "generated": text, "score": score(ex, text),
                            "seconds": round(time.perf_counter() - t0, 3)})
                t0 = time.perf_counter()
        return out

    def _simulated(self, variant: str, plan: RoutingPlan, state: PrefillState, suffix: list[int], held: list[int],
                   moend_kw: dict[str, Any], max_new: int, kw: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        from transformers import DynamicCache

        layers = simulate(plan, state, variant, held=held, alpha=self.s.alpha, moend_kw=moend_kw)
        cache = DynamicCache(config=self.model.config)
        for layer, sim in zip(cache.layers, layers):
            layer.update(sim.keys, sim.values)
        with simulated(layers, plan):
            new, _ = greedy_decode(self.model, cache, suffix, max_new, attention=HEADSIM_ATTN, **kw)
        spread = [float(x.counts.max() / x.counts.min().clamp_min(1)) for x in layers if x.keep is not None]
        return new, {"bytes": sum(x.nbytes for x in layers),
                     "head_spread_mean": round(sum(spread) / len(spread), 3) if spread else 1.0,
                     "head_spread_max": round(max(spread), 3) if spread else 1.0}
