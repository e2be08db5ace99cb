"""Teacher-forced continuation KL / loss of each method on long real text."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text
from moend_fx.eval import methods as mth
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.plan_book import PlanBook
from moend_fx.eval.runner import load_records
from moend_fx.eval.steps import eval_attention_on, model_device, prefill
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan

# What a continuation record is keyed on when a stopped run resumes (the digest: the sequence's token ids).
RECORD_FIELDS = ("sequence", "context_length", "digest", "method", "budget")


@torch.inference_mode()
def continuation_eval(model: Any, table: SensitivityTable, token_ids: torch.Tensor, context_length: int, *,
                      methods: Sequence[str], budgets: Sequence[str], window: int = QUERY_WINDOW,
                      progress: bool = True, records: str | Path | None = None,
                      resume: bool = True) -> list[dict[str, Any]]:
    """Teacher-forced continuation quality of each method on real text.

    token_ids: [N, T] with T > context_length + 1. The first ``context_length`` tokens are prefilled once at
    full precision, each method compresses that state, then the remaining ``C = T - context_length`` tokens
    are fed as one chunk through its cache. Per record: ``kl`` = mean over the C positions of
    KL(full || method) of the next-token distributions, ``loss`` = mean next-token cross-entropy on the
    continuation (nats; positions 1..C-1), ``loss_full`` the same for the full cache, and measured bytes.

    ``records``: a JSON-lines file rewritten (atomically) after every sequence, holding every record so far,
    including those of other context lengths already in it; with ``resume`` a sequence whose records are all
    there (same index, context length, token ids, methods and budgets) is not run again.
    """
    from tqdm.auto import tqdm

    ids = torch.as_tensor(token_ids)
    if ids.dim() != 2 or ids.shape[1] < context_length + 2:
        raise MoendError(f"token_ids {tuple(ids.shape)} must be [N, T] with T >= context_length + 2 = "
                         f"{context_length + 2}")
    runnable, _ = mth.check_methods(methods, model=model)
    run = _ContinuationRun(model, table, EvalConfig(methods=tuple(runnable), budgets=tuple(budgets), window=window))
    path = Path(records) if records is not None else None
    store: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    if path is not None and resume and path.exists():
        for r in load_records(path, RECORD_FIELDS, restart="pass --no-resume to start the continuation over"):
            store[r["context_length"], r["sequence"]].append(r)
    runs = {(spec.name, budget) for spec, budget in mth.method_runs(run.cfg.methods, run.cfg.budgets)}
    out: list[dict[str, Any]] = []
    for i in tqdm(range(ids.shape[0]), desc=f"continuation {context_length}", unit="seq", disable=not progress):
        digest = sequence_digest(ids[i])
        done = [r for r in store[context_length, i] if r["digest"] == digest and (r["method"], r["budget"]) in runs]
        if {(r["method"], r["budget"]) for r in done} == runs:
            out += done
            continue
        store[context_length, i] = recs = run.sequence(i, ids[i], context_length)
        out += recs
        if path is not None:
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for rs in store.values() for r in rs))
    return out


def sequence_digest(row: torch.Tensor) -> str:
    """A short hash of a sequence's token ids ``row`` [T]: resumed records must be of the same text."""
    return hashlib.sha1(torch.as_tensor(row, dtype=torch.int64).numpy().tobytes()).hexdigest()[:16]


class _ContinuationRun:
    """Every method x budget of one :func:`continuation_eval` call, one held-out sequence at a time."""

    def __init__(self, model: Any, table: SensitivityTable, cfg: EvalConfig) -> None:
        self.model, self.cfg = model, cfg
        self.fp = ModelFingerprint.from_model(model)
        self.plans = PlanBook(table)
        self.moend_kw = mth.moend_options(model, table, window=cfg.window)
        self.dev = model_device(model)

    def _log_probs(self, spec: mth.MethodSpec, state: mth.PrefillState, cont: torch.Tensor,
                   plan: RoutingPlan | None = None) -> tuple[torch.Tensor, int]:
        """(log p [C, V] float32 of the continuation ``cont`` [C] fed through the method's cache, its bytes)."""
        cache = mth.build_cache(spec, state, model=self.model, plan=plan, **self.moend_kw)
        measured = mth.cache_nbytes(cache)
        with eval_attention_on(self.model):
            logits = self.model(input_ids=cont[None].to(self.dev), cache=cache, use_cache=True).logits[0].float()
        return torch.log_softmax(logits, -1), measured

    def sequence(self, i: int, row: torch.Tensor, context_length: int) -> list[dict[str, Any]]:
        """The records of sequence ``i`` (``row`` [T] token ids; its first ``context_length`` are the context)."""
        ctx, cont = row[:context_length].tolist(), row[context_length:]
        digest = sequence_digest(row)
        state = prefill(self.model, ctx, window=self.cfg.window)
        T = state.length
        target = cont[1:].to(self.dev)
        ref_lp, ref_bytes = self._log_probs(mth.METHODS["full"], state, cont)
        loss_full = float(torch.nn.functional.nll_loss(ref_lp[:-1], target))
        out: list[dict[str, Any]] = []
        for spec, budget in mth.method_runs(self.cfg.methods, self.cfg.budgets):
            rec: dict[str, Any] = dict(sequence=i, context_length=context_length, digest=digest,
                                       context_tokens=T,
                                       continuation_tokens=int(cont.numel()),
                                       method=spec.name, budget=budget, loss_full=loss_full,
                                       full16_bytes=full_cache_bytes(self.fp, T, dtype="16bit"),
                                       full_model_bytes=full_cache_bytes(self.fp, T, dtype=None))
            plan = None
            if spec.kind == "moend":
                entry = self.plans.get(spec.name, budget, T)
                if entry.plan is None:
                    out.append(dict(rec, infeasible=entry.infeasible, kl=None, loss=None, measured_bytes=None))
                    continue
                plan = entry.plan
            full = spec.name == "full"
            lp, measured = (ref_lp, ref_bytes) if full else self._log_probs(spec, state, cont, plan)
            kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
            loss = float(torch.nn.functional.nll_loss(lp[:-1], target))
            out.append(dict(rec, kl=kl, loss=loss, measured_bytes=measured,
                            ratio16=rec["full16_bytes"] / measured, ratio_model=rec["full_model_bytes"] / measured))
        return out
