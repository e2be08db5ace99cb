"""The evaluation harness: one full-precision prefill per example, every method compressing a copy of it.

    >>> cfg = EvalConfig(tasks=("passkey",), lengths=(2048,), n=30, budgets=("4x", "8x", "14x"))
    >>> result = run_eval(model, tokenizer, table, cfg, out_dir="results/passkey-2k")
    >>> write_report(result.records, "results/passkey-2k", meta=result.meta)   # moend_fx.eval.report

Per example (design.md, "Evaluation protocol"):

1. the context (intro + context) is prefilled once at full precision with SDPA, recording each layer's K/V
   and last ``window`` post-RoPE queries (a :class:`~moend_fx.eval.methods.PrefillState`);
2. ``query_agnostic``: each method builds its cache from that state (compressing it for the context's length),
   then the question + answer prefix are fed through the compressed cache and the answer is decoded;
3. ``query_aware``: the question is appended to a full-precision copy of the prefill (one more chunk, still
   SDPA), each method compresses *that* state, the answer prefix is fed and the answer decoded.

So N methods cost one prefill (plus one question chunk), not N. Decoding is greedy and stops at a newline
after the answer has started, at EOS, once the answers' count of answer-shaped strings is complete (extra
text cannot change a strict score), or after ``max_new_tokens``. Methods whose plans coincide at a budget
share one decode (the record says which). Memory is *measured* (``cache_nbytes``) after prefill +
compression (``measured_bytes``, ``ratio16``, ``ratio_model``: against a 16-bit cache and the model-dtype cache
of the prompt's tokens) and at its peak over the question and answer (``peak_bytes``, ``peak_ratio16``: the
most the cache held after any forward pass, :class:`~moend_fx.eval.peak_bytes.PeakBytes`).
"""

from __future__ import annotations

import json
import platform
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.common.host import cpu_name
from moend_fx.common.io import atomic_write_text
from moend_fx.common.options import Setting
from moend_fx.eval.config import EvalConfig, EvalResult
from moend_fx.eval.methods import MethodSpec, PrefillState, build_cache, check_methods, method_runs
from moend_fx.eval.peak_bytes import PeakBytes
from moend_fx.eval.records import RUN_FIELDS, load_records
from moend_fx.eval.setting_plans import setting_plans
from moend_fx.eval.steps import (
    EVAL_ATTN,
    decode,
    encode,
    greedy_decode,
    prefill,
    stop_reason,
)
from moend_fx.eval.tasks.registry import Example, make_examples, score
from moend_fx.plan.memory import full_cache_bytes, parse_budget
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan

# (setting, method, budget): one run of an example; budget None for the budget-free methods (full, lossless).
RunKey = tuple[str, str, str | None]

# A record of a method whose plan equals an earlier method's (same example) copies that decode's figures.
_SHARED = ("measured_bytes", "ratio16", "ratio_model", "peak_bytes", "peak_ratio16", "generated", "new_tokens",
           "stop", "score", "decode_s")

# --------------------------------------------------------------------------------------------- runner


def check_context(model: Any, config: EvalConfig) -> None:
    """A MoendError before any prefill when the longest prompt plus its answer tokens would run past the model's
    trained context (``max_position_embeddings``): positions beyond it give no error, only meaningless scores."""
    cfg = getattr(model.config, "text_config", None) or model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    need = max(config.lengths) + config.max_new_tokens
    if limit is not None and need > limit:
        raise MoendError(
            f"length {max(config.lengths)} + max_new_tokens {config.max_new_tokens} = {need} tokens exceeds "
            f"this model's context of {limit} (max_position_embeddings); allowed lengths: <= "
            f"{limit - config.max_new_tokens}"
        )


def example_contexts(model: Any, tokenizer: Any, ex: Example, settings: Iterable[str], *, window: int,
                     ) -> Iterator[tuple[Setting, PrefillState, list[int], float]]:
    """(setting, full-precision prefill, suffix token ids fed after it, prefill seconds) of ``ex`` for each of
    ``settings``: query-agnostic first (the context alone; the question and answer prefix are the suffix), then
    query-aware (the question prefilled on top of the same context; the answer prefix is the suffix)."""
    settings = set(settings)
    head = ex.prefill_text(Setting.QUERY_AGNOSTIC)
    head_ids = encode(tokenizer, head, special=True)
    query_ids = encode(tokenizer, ex.prefill_text(Setting.QUERY_AWARE)[len(head):])
    prefix_ids = encode(tokenizer, ex.suffix_text(Setting.QUERY_AWARE))
    t0 = time.perf_counter()
    ctx = prefill(model, head_ids, window=window)
    prefill_s = time.perf_counter() - t0
    if Setting.QUERY_AGNOSTIC in settings:
        yield Setting.QUERY_AGNOSTIC, ctx, query_ids + prefix_ids, prefill_s
    if Setting.QUERY_AWARE in settings:
        t0 = time.perf_counter()
        full = prefill(model, query_ids, window=window, base=ctx)
        yield Setting.QUERY_AWARE, full, prefix_ids, prefill_s + time.perf_counter() - t0


def spread_order(n: int) -> list[int]:
    """The indices 0 .. n-1 in an order whose every prefix spreads over the range: 0, n-1, then the unused index
    nearest each point of the van der Corput sequence (1/2, 1/4, 3/4, 1/8, 5/8, ...) of [0, n-1]."""
    order = list(dict.fromkeys([0, n - 1]))[:n]
    k = 1
    while len(order) < n:
        x, f, i = 0.0, 0.5, k  # the k-th van der Corput point: k's binary digits mirrored after the point
        while i:
            x, i, f = x + f * (i & 1), i >> 1, f / 2
        k += 1
        free = [j for j in range(n) if j not in order]
        order.append(min(free, key=lambda j: (abs(j - x * (n - 1)), j)))
    return order


class Runner:
    """Runs methods x budgets on examples for one model + table (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, tables: SensitivityTable | Mapping[str, SensitivityTable],
                 config: EvalConfig, progress: bool = True) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, config
        self.methods, self.skipped = check_methods(config.methods, model=model)
        self.fp = ModelFingerprint.from_model(model)
        self.by_setting = setting_plans(model, tables, config)
        self.progress = progress
        self.eos = getattr(tokenizer, "eos_token_id", None)
        # every record of this invocation names it: methods of one example share a prefill only within one
        self.run_id = uuid.uuid4().hex[:12]
        for b in config.budgets:
            parse_budget(b, self.fp, max(config.lengths))  # fail now on a bad budget string
        check_context(model, config)

    # -- one example ------------------------------------------------------------------------------
    def run_example(self, ex: Example, only: set[RunKey] | None = None) -> list[dict[str, Any]]:
        """Every (setting, method, budget) run of ``ex``, or only those in ``only`` (a resumed example)."""
        settings = {k[0] for k in only} if only is not None else set(self.cfg.settings)  # str == its Setting
        out = []
        for setting, state, suffix, prefill_s in example_contexts(self.model, self.tokenizer, ex, settings,
                                                                  window=self.cfg.window):
            out += self._methods(ex, setting, state, suffix, prefill_s, only)
        return out

    def runs(self) -> list[RunKey]:
        """Every (setting, method, budget) an example is run with under this config."""
        return [(str(s), spec.name, b) for s in self.cfg.settings for spec, b in method_runs(self.methods,
                                                                                              self.cfg.budgets)]

    def _methods(self, ex: Example, setting: Setting, state: PrefillState, suffix: list[int],
                 prefill_s: float, only: set[RunKey] | None = None) -> list[dict[str, Any]]:
        T = state.length
        base = dict(task=ex.task, target_length=ex.meta.get("target_length"), index=ex.meta.get("index"),
                    seed=self.cfg.seed, run=self.run_id, setting=str(setting), context_tokens=T,
                    suffix_tokens=len(suffix), answers=list(ex.answers),
                    full16_bytes=full_cache_bytes(self.fp, T, dtype="16bit"),
                    full_model_bytes=full_cache_bytes(self.fp, T, dtype=None), prefill_s=round(prefill_s, 3))
        done: dict[Any, dict[str, Any]] = {}  # plan layers -> record, to share identical plans' decodes
        recs = []
        for spec, budget in method_runs(self.methods, self.cfg.budgets):
            if only is not None and (str(setting), spec.name, budget) not in only:
                continue
            rec = dict(base, method=spec.name, budget=budget)
            plan = None
            if spec.kind == "moend":
                entry = self.by_setting[setting].plans.get(spec.name, budget, T)
                rec.update(budget_bytes=entry.budget_bytes, predicted_loss=entry.predicted_loss)
                if entry.plan is None:
                    rec.update(infeasible=entry.infeasible, score=None, measured_bytes=None)
                    recs.append(rec)
                    continue
                plan = entry.plan
                if plan.layers in done:
                    prev = done[plan.layers]
                    rec.update({k: prev[k] for k in _SHARED}, shared_with=f"{prev['method']}@{prev['budget']}")
                    recs.append(rec)
                    continue
            elif budget is None:
                rec["budget_bytes"] = None
            rec.update(self._decode(ex, spec, state, suffix, plan, base, self.by_setting[setting].moend_kw))
            if plan is not None:
                done[plan.layers] = rec
            recs.append(rec)
        return recs

    def _decode(self, ex: Example, spec: MethodSpec, state: PrefillState, suffix: list[int],
                plan: RoutingPlan | None, base: dict[str, Any], moend_kw: dict[str, Any]) -> dict[str, Any]:
        """One method's cache from ``state``, then ``suffix`` and the greedy answer: the record's figures."""
        t0 = time.perf_counter()
        cache = build_cache(spec, state, model=self.model, plan=plan, **moend_kw)
        peak = PeakBytes(cache)
        measured = peak.after_prompt
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        new, why = greedy_decode(self.model, cache, suffix, self.cfg.max_new(len(ex.answers)), tokenizer=self.tokenizer,
                                 stop=lambda s, ex=ex: stop_reason(ex, s), eos_token_id=self.eos,
                                 after_step=peak.update)
        text = decode(self.tokenizer, new)
        return dict(measured_bytes=measured, ratio16=base["full16_bytes"] / measured,
                    ratio_model=base["full_model_bytes"] / measured, peak_bytes=peak.bytes,
                    peak_ratio16=base["full16_bytes"] / peak.bytes, generated=text, new_tokens=len(new),
                    stop=why, score=score(ex, text), build_s=round(build_s, 3),
                    decode_s=round(time.perf_counter() - t0, 3))

    # -- everything -------------------------------------------------------------------------------
    def examples(self) -> list[Example]:
        """Length-major, then example index in :func:`spread_order`, then task: a run stopped early still has every
        task at (nearly) the same n, and its examples' needle depths (spread evenly over [0, 1] by index) span the
        whole range instead of its shallow end."""
        out = []
        for length in self.cfg.lengths:
            per_task = [make_examples(t, self.tokenizer, length, self.cfg.n, seed=self.cfg.seed)
                        for t in self.cfg.tasks]
            out += [exs[i] for i in spread_order(self.cfg.n) for exs in per_task]
        return out

    def run(self, out_dir: str | Path | None = None, resume: bool = True) -> EvalResult:
        from tqdm.auto import tqdm

        records: list[dict[str, Any]] = []
        done: set[tuple] = set()
        path = Path(out_dir) / "records.jsonl" if out_dir is not None else None
        if path is not None and resume and path.is_file():
            records = load_records(path)
            other = sorted({r["seed"] for r in records if r.get("seed", self.cfg.seed) != self.cfg.seed})
            if other:
                raise MoendError(f"{path} holds records of seed {', '.join(map(str, other))}, not --seed "
                                 f"{self.cfg.seed}: write to another --out (moend report pools runs of different "
                                 "seeds), or pass --no-resume to start over")
            # Per run, not per example: a resumed run with more methods or budgets runs only what is missing.
            done = {tuple(r[k] for k in RUN_FIELDS) for r in records}
        exs = self.examples()
        runs = self.runs()
        prev_attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(EVAL_ATTN)
        try:
            bar = tqdm(exs, desc="eval", unit="ex", disable=not self.progress, dynamic_ncols=True)
            for ex in bar:
                key = (ex.task, ex.meta["target_length"], ex.meta["index"])
                missing = {r for r in runs if key + r not in done}
                if not missing:
                    continue
                bar.set_postfix_str(f"{ex.task}@{ex.meta['target_length']} #{ex.meta['index']}")
                records += self.run_example(ex, only=None if len(missing) == len(runs) else missing)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        finally:
            self.model.set_attn_implementation(prev_attn)
        return EvalResult(records, self.plan_summaries(), self.meta())

    def plan_summaries(self) -> dict[str, Any]:
        """``{"method|budget|length": plan facts}``, keyed ``"setting|method|budget|length"`` when the settings
        plan on different tables."""
        out = {}
        shared = len({id(p) for p in self.by_setting.values()}) == 1
        for setting, sp in self.by_setting.items():
            for (method, budget, length), e in sorted(sp.plans._plans.items()):
                key = f"{method}|{budget}|{length}" if shared else f"{setting}|{method}|{budget}|{length}"
                out[key] = self._plan_summary(method, budget, length, e)
        return out

    @staticmethod
    def _plan_summary(method: str, budget: str, length: int, e: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"method": method, "budget": budget, "context_length": length,
                             "budget_bytes": e.budget_bytes}
        if e.plan is None:
            d["infeasible"] = e.infeasible
        else:
            d.update(solver=e.plan.solver, predicted_loss=e.predicted_loss, bytes_planned=e.plan.bytes_planned,
                     solve_s=round(e.solve_s, 4), layers=[c.name for c in e.plan.layers],
                     mean_keep=sum(c.keep_ratio for c in e.plan.layers) / len(e.plan.layers))
        return d

    def meta(self) -> dict[str, Any]:
        import transformers

        return {
            "config": self.cfg.to_dict(), "skipped_methods": self.skipped,
            "model": self.fp.to_dict(),
            **self.by_setting[self.cfg.settings[0]].summary(self.cfg.calibrated_stats),
            "settings": {str(s): sp.summary(self.cfg.calibrated_stats) for s, sp in self.by_setting.items()},
            "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.machine(), "cpu": cpu_name(), "run": self.run_id, "threads": torch.get_num_threads(),
            "ratio_base": "16-bit cache of the same tokens (ratio16); the model's own dtype (ratio_model)",
        }


def run_eval(model: Any, tokenizer: Any, tables: SensitivityTable | Mapping[str, SensitivityTable],
             config: EvalConfig, out_dir: str | Path | None = None, *, progress: bool = True,
             resume: bool = True) -> EvalResult:
    """Run ``config`` and return every record (one per example x setting x method x budget). tables: one
    SensitivityTable for every setting, or ``{setting: table}`` (``moend_fx.eval.setting_plans``)."""
    return Runner(model, tokenizer, tables, config, progress=progress).run(out_dir, resume=resume)
