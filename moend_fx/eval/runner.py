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
share one decode (the record says which). Memory is *measured* after prefill + compression
(``cache_nbytes``), and reported against a 16-bit cache and the model-dtype cache of the same tokens.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moend_fx.errors import MoendError
from moend_fx.eval.methods import (
    METHODS,
    PlanBook,
    PrefillState,
    build_cache,
    cache_nbytes,
    check_methods,
)
from moend_fx.eval.tasks import SETTINGS, TASKS, Example, candidates, make_examples, score
from moend_fx.hf_attention import moend_attention
from moend_fx.io import atomic_write_text
from moend_fx.memory import full_cache_bytes, parse_budget
from moend_fx.plan import ModelFingerprint
from moend_fx.rope import rope_from_model
from moend_fx.scoring import SCORERS
from moend_fx.sensitivity import SensitivityTable

EVAL_ATTN = "moend_eval"


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class EvalConfig:
    """What to run. budgets: ratios of the 16-bit cache ("14x") or sizes ("3.3MB"); settings: SETTINGS.

    max_new_tokens: decode cap per answer (raised to ``tokens_per_answer`` x answers for multi-answer tasks).
    window: post-RoPE queries recorded per layer for scorers without calibrated stats.
    """

    tasks: tuple[str, ...] = ("passkey",)
    lengths: tuple[int, ...] = (2048,)
    n: int = 30
    budgets: tuple[str, ...] = ("4x", "8x", "14x")
    methods: tuple[str, ...] = ("full", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero", "2d_hetero_exact")
    settings: tuple[str, ...] = SETTINGS
    seed: int = 0
    max_new_tokens: int = 24
    tokens_per_answer: int = 8
    window: int = 32
    evict_every: int = 128
    scorer: str | None = None  # override the plan's eviction scorer (e.g. "snapkv") for every MoENDCache method
    calibrated_stats: bool = True  # trig: the table's query statistics (False: estimate from the query window)

    def __post_init__(self) -> None:
        for name in ("tasks", "lengths", "budgets", "methods", "settings"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise MoendError(f"{name} is empty; give at least one")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise MoendError(f"task {bad[0]!r} is unknown; allowed: {', '.join(TASKS)}")
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise MoendError(f"setting {bad[0]!r} is unknown; allowed: {', '.join(SETTINGS)}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise MoendError(f"method {bad[0]!r} is unknown; allowed: {', '.join(METHODS)}")
        for name in ("n", "max_new_tokens", "window", "evict_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoendError(f"{name}={v!r} is invalid; allowed: an integer >= 1")
        if self.scorer is not None and self.scorer not in SCORERS:
            raise MoendError(f"scorer {self.scorer!r} is unknown; allowed: {', '.join(sorted(SCORERS))}")
        for length in self.lengths:
            if isinstance(length, bool) or not isinstance(length, int) or length < 16:
                raise MoendError(f"length {length!r} is invalid; allowed: an integer >= 16 (tokens)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    records: list[dict[str, Any]]
    plans: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- tokens


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text`` (``special``: add the tokenizer's special tokens, as for a prompt's start)."""
    if callable(tokenizer):
        ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    raise MoendError(f"tokenizer {type(tokenizer).__name__} has neither __call__ nor encode")


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------- attention hook


class QueryRecorder:
    """Keeps the last ``window`` post-RoPE queries [B, H, W, D] of every layer across forward chunks."""

    def __init__(self, num_layers: int, window: int, initial: Sequence[torch.Tensor | None] | None = None):
        self.window = window
        self.q: list[torch.Tensor | None] = list(initial) if initial is not None else [None] * num_layers

    def record(self, layer: int, query: torch.Tensor) -> None:
        q = query[:, :, -self.window:].detach()
        prev = self.q[layer]
        if prev is not None and q.shape[2] < self.window:
            q = torch.cat([prev, q], dim=2)[:, :, -self.window:]
        self.q[layer] = q


_RECORDER: QueryRecorder | None = None


def eval_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The "moend" attention function (SDPA for plain caches, packed attention for MoENDCache) that also
    records the queries of a prefill when a :class:`QueryRecorder` is active. query: [B, H, L, D]."""
    if _RECORDER is not None:
        _RECORDER.record(module.layer_idx, query)
    return moend_attention(module, query, key, value, attention_mask, **kwargs)


def register_eval_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EVAL_ATTN, eval_attention)
    AttentionMaskInterface.register(EVAL_ATTN, sdpa_mask)


register_eval_attention()


@contextmanager
def eval_attention_on(model: Any) -> Iterator[None]:
    """Run ``model`` with the "moend_eval" attention inside the block (restored after; no-op if already on)."""
    prev = model.config._attn_implementation
    if prev == EVAL_ATTN:
        yield
        return
    model.set_attn_implementation(EVAL_ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(prev)


# --------------------------------------------------------------------------------------------- model steps


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def prefill(model: Any, ids: Sequence[int], *, window: int = 32, base: PrefillState | None = None) -> PrefillState:
    """Full-precision prefill of ``ids`` (after ``base``'s tokens, if given) into a new :class:`PrefillState`."""
    from transformers import DynamicCache

    global _RECORDER
    if not ids:
        raise MoendError("nothing to prefill: the token list is empty")
    cache = DynamicCache(config=model.config)
    if base is not None:
        for layer, (k, v) in zip(cache.layers, base.kv):
            layer.update(k, v)
    n_layers = model.config.num_hidden_layers
    _RECORDER = QueryRecorder(n_layers, window, base.queries if base is not None else None)
    try:
        with eval_attention_on(model):
            model(input_ids=torch.tensor([list(ids)], device=_device(model)), cache=cache, use_cache=True,
                  logits_to_keep=1)
        queries = _RECORDER.q
    finally:
        _RECORDER = None
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return PrefillState(kv, queries, kv[0][0].shape[2])


def _extends(match: str, ch: str) -> bool:
    """Whether character ``ch`` could continue the answer-shaped string it ends."""
    return ch.isdigit() if match == "number" else ch.isalpha()


def stop_reason(example: Example, text: str) -> str | None:
    """Why decoding may stop after ``text`` (None = go on): a newline once the answer started, or every
    expected answer-shaped string complete (strict scoring reads only those)."""
    if "\n" in text.lstrip():
        return "newline"
    if text and len(candidates(example, text)) >= len(example.answers) and not _extends(example.match, text[-1]):
        return "answers"
    return None


@torch.inference_mode()
def greedy_decode(model: Any, cache: Any, suffix_ids: Sequence[int], max_new_tokens: int, *,
                  tokenizer: Any = None, stop: Callable[[str], str | None] | None = None,
                  eos_token_id: int | None = None) -> tuple[list[int], str]:
    """Feed ``suffix_ids`` through ``cache`` then decode greedily. Returns (new token ids, stop reason:
    "eos", "max_new_tokens" or what ``stop(decoded text)`` said)."""
    dev = _device(model)
    ids = torch.tensor([list(suffix_ids)], device=dev)
    out: list[int] = []
    for _ in range(max_new_tokens):
        with eval_attention_on(model):
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        nxt = int(logits[0, -1].argmax())
        if eos_token_id is not None and nxt == eos_token_id:
            return out, "eos"
        out.append(nxt)
        if stop is not None:
            why = stop(decode(tokenizer, out))
            if why:
                return out, why
        ids = torch.tensor([[nxt]], device=dev)
    return out, "max_new_tokens"


# --------------------------------------------------------------------------------------------- runner


class Runner:
    """Runs methods x budgets on examples for one model + table (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, table: SensitivityTable, config: EvalConfig,
                 progress: bool = True) -> None:
        table.check_model(model)
        self.model, self.tokenizer, self.table, self.cfg = model, tokenizer, table, config
        self.methods, self.skipped = check_methods(config.methods)
        self.fp = ModelFingerprint.from_model(model)
        self.plans = PlanBook(table)
        self.progress = progress
        try:
            rope = rope_from_model(model)
        except MoendError:
            rope = None
        use_stats = table.has_stats() and config.calibrated_stats
        stats = [table.layer_stats(i) for i in range(table.num_layers)] if use_stats else None
        self.moend_kw = dict(rope=rope, query_stats=stats, window=config.window, evict_every=config.evict_every)
        if config.scorer is not None:
            self.moend_kw["scorer"] = config.scorer
        self.eos = getattr(tokenizer, "eos_token_id", None)
        for b in config.budgets:
            parse_budget(b, self.fp, max(config.lengths))  # fail now on a bad budget string

    # -- one example ------------------------------------------------------------------------------
    def run_example(self, ex: Example) -> list[dict[str, Any]]:
        tok = self.tokenizer
        head = ex.prefill_text("query_agnostic")
        head_ids = encode(tok, head, special=True)
        query_ids = encode(tok, ex.prefill_text("query_aware")[len(head):])
        prefix_ids = encode(tok, ex.suffix_text("query_aware"))
        t0 = time.perf_counter()
        ctx = prefill(self.model, head_ids, window=self.cfg.window)
        prefill_s = time.perf_counter() - t0
        out = []
        if "query_agnostic" in self.cfg.settings:
            out += self._methods(ex, "query_agnostic", ctx, query_ids + prefix_ids, prefill_s)
        if "query_aware" in self.cfg.settings:
            t0 = time.perf_counter()
            full = prefill(self.model, query_ids, window=self.cfg.window, base=ctx)
            out += self._methods(ex, "query_aware", full, prefix_ids, prefill_s + time.perf_counter() - t0)
        return out

    def _max_new(self, ex: Example) -> int:
        return max(self.cfg.max_new_tokens, self.cfg.tokens_per_answer * len(ex.answers))

    def _methods(self, ex: Example, setting: str, state: PrefillState, suffix: list[int],
                 prefill_s: float) -> list[dict[str, Any]]:
        T = state.length
        base = dict(task=ex.task, target_length=ex.meta.get("target_length"), index=ex.meta.get("index"),
                    setting=setting, context_tokens=T, suffix_tokens=len(suffix), answers=list(ex.answers),
                    full16_bytes=full_cache_bytes(self.fp, T, dtype="16bit"),
                    full_model_bytes=full_cache_bytes(self.fp, T, dtype=None), prefill_s=round(prefill_s, 3))
        done: dict[Any, dict[str, Any]] = {}  # plan layers -> record, to share identical plans' decodes
        recs = []
        for name in self.methods:
            spec = METHODS[name]
            for budget in (self.cfg.budgets if spec.budgeted else (None,)):
                rec = dict(base, method=name, budget=budget)
                plan = None
                if spec.kind == "moend":
                    entry = self.plans.get(name, budget, T)
                    rec.update(budget_bytes=entry.budget_bytes, predicted_loss=entry.predicted_loss)
                    if entry.plan is None:
                        rec.update(infeasible=entry.infeasible, score=None, measured_bytes=None)
                        recs.append(rec)
                        continue
                    plan = entry.plan
                    key = plan.layers
                    if key in done:
                        prev = done[key]
                        rec.update({k: prev[k] for k in ("measured_bytes", "ratio16", "ratio_model", "generated",
                                                          "new_tokens", "stop", "score", "decode_s")},
                                   shared_with=f"{prev['method']}@{prev['budget']}")
                        recs.append(rec)
                        continue
                elif budget is None and spec.kind != "moend":
                    rec["budget_bytes"] = None
                t0 = time.perf_counter()
                cache = build_cache(spec, state, model=self.model, plan=plan, **self.moend_kw)
                measured = cache_nbytes(cache)
                build_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                new, why = greedy_decode(self.model, cache, suffix, self._max_new(ex), tokenizer=self.tokenizer,
                                         stop=lambda s, ex=ex: stop_reason(ex, s), eos_token_id=self.eos)
                text = decode(self.tokenizer, new)
                rec.update(measured_bytes=measured, ratio16=base["full16_bytes"] / measured,
                           ratio_model=base["full_model_bytes"] / measured, generated=text, new_tokens=len(new),
                           stop=why, score=score(ex, text), build_s=round(build_s, 3),
                           decode_s=round(time.perf_counter() - t0, 3))
                del cache
                if plan is not None:
                    done[plan.layers] = rec
                recs.append(rec)
        return recs

    # -- everything -------------------------------------------------------------------------------
    def examples(self) -> list[Example]:
        """Length-major, then example index, then task: a run stopped early still has every task at
        (nearly) the same n."""
        out = []
        for length in self.cfg.lengths:
            per_task = [make_examples(t, self.tokenizer, length, self.cfg.n, seed=self.cfg.seed)
                        for t in self.cfg.tasks]
            out += [exs[i] for i in range(self.cfg.n) for exs in per_task]
        return out

    def run(self, out_dir: str | Path | None = None, resume: bool = True) -> EvalResult:
        from tqdm.auto import tqdm

        records: list[dict[str, Any]] = []
        done: set[tuple] = set()
        path = Path(out_dir) / "records.jsonl" if out_dir is not None else None
        if path is not None and resume and path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            done = {(r["task"], r["target_length"], r["index"]) for r in records}
        exs = self.examples()
        prev_attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(EVAL_ATTN)
        try:
            bar = tqdm(exs, desc="eval", unit="ex", disable=not self.progress, dynamic_ncols=True)
            for ex in bar:
                key = (ex.task, ex.meta["target_length"], ex.meta["index"])
                if key in done:
                    continue
                bar.set_postfix_str(f"{ex.task}@{ex.meta['target_length']} #{ex.meta['index']}")
                records += self.run_example(ex)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        finally:
            self.model.set_attn_implementation(prev_attn)
        return EvalResult(records, self.plan_summaries(), self.meta())

    def plan_summaries(self) -> dict[str, Any]:
        out = {}
        for (method, budget, length), e in sorted(self.plans._plans.items()):
            d: dict[str, Any] = {"method": method, "budget": budget, "context_length": length,
                                 "budget_bytes": e.budget_bytes}
            if e.plan is None:
                d["infeasible"] = e.infeasible
            else:
                d.update(solver=e.plan.solver, predicted_loss=e.predicted_loss, bytes_planned=e.plan.bytes_planned,
                         solve_s=round(e.solve_s, 4), layers=[c.name for c in e.plan.layers],
                         mean_keep=sum(c.keep_ratio for c in e.plan.layers) / len(e.plan.layers))
            out[f"{method}|{budget}|{length}"] = d
        return out

    def meta(self) -> dict[str, Any]:
        import transformers

        return {
            "config": self.cfg.to_dict(), "skipped_methods": self.skipped,
            "model": self.fp.to_dict(), "table": self.table.summary().get("calibration"),
            "scorer": self.cfg.scorer or str(self.table.calibration.get("scorer", "trig")),
            "scorer_stats": ("calibrated" if self.table.has_stats() and self.cfg.calibrated_stats
                             else "estimated from the query window"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "ratio_base": "16-bit cache of the same tokens (ratio16); the model's own dtype (ratio_model)",
        }


def run_eval(model: Any, tokenizer: Any, table: SensitivityTable, config: EvalConfig,
             out_dir: str | Path | None = None, *, progress: bool = True, resume: bool = True) -> EvalResult:
    """Run ``config`` and return every record (one per example x setting x method x budget)."""
    return Runner(model, tokenizer, table, config, progress=progress).run(out_dir, resume=resume)


# --------------------------------------------------------------------------------------------- continuation


@torch.inference_mode()
def continuation_eval(model: Any, table: SensitivityTable, token_ids: torch.Tensor, context_length: int, *,
                      methods: Sequence[str], budgets: Sequence[str], window: int = 32,
                      progress: bool = True) -> list[dict[str, Any]]:
    """Teacher-forced continuation quality of each method on real text.

    token_ids: [N, T] with T > context_length + 1. The first ``context_length`` tokens are prefilled once at
    full precision, each method compresses that state, then the remaining ``C = T - context_length`` tokens
    are fed as one chunk through its cache. Per record: ``kl`` = mean over the C positions of
    KL(full || method) of the next-token distributions, ``loss`` = mean next-token cross-entropy on the
    continuation (nats; positions 1..C-1), ``loss_full`` the same for the full cache, and measured bytes.
    """
    from tqdm.auto import tqdm

    ids = torch.as_tensor(token_ids)
    if ids.dim() != 2 or ids.shape[1] < context_length + 2:
        raise MoendError(f"token_ids {tuple(ids.shape)} must be [N, T] with T >= context_length + 2 = "
                         f"{context_length + 2}")
    runnable, _ = check_methods(methods)
    runner_cfg = EvalConfig(methods=tuple(runnable), budgets=tuple(budgets), window=window)
    fp = ModelFingerprint.from_model(model)
    plans = PlanBook(table)
    try:
        rope = rope_from_model(model)
    except MoendError:
        rope = None
    stats = [table.layer_stats(i) for i in range(table.num_layers)] if table.has_stats() else None
    moend_kw = dict(rope=rope, query_stats=stats, window=window)
    dev = _device(model)
    out: list[dict[str, Any]] = []
    for i in tqdm(range(ids.shape[0]), desc="continuation", unit="seq", disable=not progress):
        ctx, cont = ids[i, :context_length].tolist(), ids[i, context_length:]
        state = prefill(model, ctx, window=window)
        T = state.length
        target = cont[1:].to(dev)

        def run(spec, plan=None, state=state, cont=cont):
            cache = build_cache(spec, state, model=model, plan=plan, **moend_kw)
            measured = cache_nbytes(cache)
            with eval_attention_on(model):
                logits = model(input_ids=cont[None].to(dev), cache=cache, use_cache=True).logits[0].float()
            return torch.log_softmax(logits, -1), measured

        ref_lp, ref_bytes = run(METHODS["full"])
        loss_full = float(torch.nn.functional.nll_loss(ref_lp[:-1], target))
        for name in runner_cfg.methods:
            spec = METHODS[name]
            for budget in (runner_cfg.budgets if spec.budgeted else (None,)):
                rec: dict[str, Any] = dict(sequence=i, context_length=context_length, context_tokens=T,
                                           continuation_tokens=int(cont.numel()),
                                           method=name, budget=budget, loss_full=loss_full,
                                           full16_bytes=full_cache_bytes(fp, T, dtype="16bit"),
                                           full_model_bytes=full_cache_bytes(fp, T, dtype=None))
                plan = None
                if spec.kind == "moend":
                    entry = plans.get(name, budget, T)
                    if entry.plan is None:
                        out.append(dict(rec, infeasible=entry.infeasible, kl=None, loss=None, measured_bytes=None))
                        continue
                    plan = entry.plan
                if name == "full":
                    lp, measured = ref_lp, ref_bytes
                else:
                    lp, measured = run(spec, plan)
                kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
                loss = float(torch.nn.functional.nll_loss(lp[:-1], target))
                out.append(dict(rec, kl=kl, loss=loss, measured_bytes=measured, ratio16=rec["full16_bytes"] / measured,
                                ratio_model=rec["full_model_bytes"] / measured))
    return out
