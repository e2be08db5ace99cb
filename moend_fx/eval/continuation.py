"""Teacher-forced continuation KL / loss of each method on long real text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import (
    METHODS,
    PlanBook,
    build_cache,
    cache_nbytes,
    check_methods,
)
from moend_fx.eval.steps import _device, eval_attention_on, prefill
from moend_fx.eviction.rope import rope_from_model
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import ModelFingerprint

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
