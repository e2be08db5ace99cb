"""Does the table predict quality? Its predicted loss (``sum_l gain[l] * S[l, c_l] ** 2`` with per-layer gains,
the paper's ``sum_l S[l, c_l]`` without) vs measured end-to-end KL.

For each held-out sequence (context of ``tokens`` tokens + a teacher-forced continuation of
``continuation`` tokens, text the calibration never saw: the ``"heldout"`` split of
:mod:`moend_fx.calibration.data` with its own seed):

1. Prefill the context once at full precision, capturing every layer's K/V and last-``window`` queries
   (the prefill itself is never compressed, as in the cache).
2. For a plan, compress each layer's context K/V as the cache does: score with the table's scorer
   (``trig`` with the table's calibrated query statistics), keep ``keep_count(T, keep)`` tokens per KV
   head (sinks, recent window, best scores), quantize the kept K/V with :class:`~moend_fx.storage.packed.PackedKV`
   (residual window in full precision) and dequantize.
3. Run the continuation tokens (positions ``T .. T+M-1``) through the model with an attention function
   in which they attend to the compressed context plus, causally, their own K/V at full precision.
   This is exactly decoding the continuation against the compressed prefill cache with teacher forcing,
   except that the new tokens stay unquantized (the cache would pack each full group of 32 appended
   tokens) and no re-eviction happens (the cache re-evicts every 128 tokens; M <= 128 here).
4. Measured loss = mean over continuation positions of ``KL(p_full || p_plan)`` of the next-token
   distributions, where ``p_full`` comes from the same run with every layer lossless.

Plans: random plans spanning light to heavy compression, plus the solver's plans at several budgets.
Reported: Pearson and Spearman correlation (all plans; solver plans alone) and the per-layer spread
(max/min over layers of S) next to the paper's. No cache object is needed for any of this.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.data import token_sequences
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.checks import check_int
from moend_fx.common.defaults import CALIBRATION_TOKENS
from moend_fx.common.errors import BudgetError, MoendError
from moend_fx.eval.proxy_report import markdown_report, write_report
from moend_fx.plan.memory import full_cache_bytes, plan_bytes
from moend_fx.plan.routing import LayerConfig, RoutingPlan

# The paper's per-layer spread (max/min across layers of S), Table/Figure in arXiv 2604.17695.
PAPER_SPREAD: tuple[tuple[str, LayerConfig, float], ...] = (
    ("evict 75% (keep 0.25, 16/16)", LayerConfig(0.25, 16, 16), 548.0),
    ("evict 90% (keep 0.1, 16/16)", LayerConfig(0.1, 16, 16), 689.0),
    ("K8 (keep 1.0, K8/V16)", LayerConfig(1.0, 8, 16), 87.0),
    ("K4 (keep 1.0, K4/V16)", LayerConfig(1.0, 4, 16), 15.0),
    ("V8 (keep 1.0, K16/V8)", LayerConfig(1.0, 16, 8), 1.6),
    ("V4 (keep 1.0, K16/V4)", LayerConfig(1.0, 16, 4), 1.2),
)
PAPER_CORRELATION = {"pearson": 0.945, "spearman": 0.937}
# markdown_report and write_report (moend_fx.eval.proxy_report) are part of this module's API.
__all__ = ["DEFAULT_BUDGETS", "PAPER_CORRELATION", "PAPER_SPREAD", "PlanResult", "ProxySettings",
           "correlations", "markdown_report", "random_plans",
           "heldout_tail", "predictor", "solver_plans", "spread_rows", "validate_proxy", "write_report"]
DEFAULT_BUDGETS: tuple[str, ...] = ("1.5x", "2x", "3x", "4x", "6x", "8x", "12x", "16x")


@dataclass(frozen=True)
class ProxySettings:
    """Held-out set and plan mix of one validation run."""

    sequences: int = 8
    tokens: int = CALIBRATION_TOKENS
    continuation: int = 64
    seed: int = 1
    random_plans: int = 24
    budgets: tuple[str, ...] = DEFAULT_BUDGETS
    solver: str = "greedy"
    plan_seed: int = 0
    window: int = 64
    # > 0: each held-out sequence's last ``tail`` tokens (inside the continuation) are a retrieval tail, questions
    # with answers about its earlier records, as calibration v4 ends its sequences: the KL then measures retrieval.
    # None: the table's own calibration text decides (:func:`heldout_tail`), so the check is like for like.
    tail: int | None = None

    def __post_init__(self) -> None:
        for name in ("sequences", "tokens", "continuation", "window"):
            check_int(name, getattr(self, name))
        for name in ("seed", "random_plans", "plan_seed"):
            check_int(name, getattr(self, name), minimum=0)
        if self.tail is not None:
            check_int("tail", self.tail, minimum=0)
            if self.tail > self.continuation:
                raise MoendError(f"tail={self.tail} is invalid; allowed: 0 to continuation={self.continuation} "
                                 "(the retrieval tail is part of the measured continuation)")
        object.__setattr__(self, "budgets", tuple(self.budgets))


@dataclass
class PlanResult:
    name: str
    kind: str  # "random" | "solver" | "uniform"
    configs: list[str]
    predicted: float
    bytes: int
    ratio_vs_16bit: float
    kl_per_sequence: list[float] = field(default_factory=list)

    @property
    def measured(self) -> float:
        return float(np.mean(self.kl_per_sequence)) if self.kl_per_sequence else float("nan")


# ------------------------------------------------------------------------------------------------ plans


def random_plans(table: SensitivityTable, n: int, seed: int) -> list[tuple[str, tuple[LayerConfig, ...]]]:
    """``n`` random plans from light to heavy: each layer is lossless with probability p (p ~ U(0, 0.6)),
    else a random grid config whose keep ratio is at least a per-plan floor (so some plans only quantize).
    """
    rng = np.random.default_rng(seed)
    configs = table.grid.configs
    lossless = [c for c in configs if c.lossless]
    keeps = sorted(table.grid.keep_ratios)
    out = []
    for i in range(n):
        p = rng.uniform(0.0, 0.6)
        floor = keeps[int(rng.integers(0, len(keeps)))]
        pool = [c for c in configs if c.keep_ratio >= floor and not c.lossless] or list(configs)
        layers = tuple(
            lossless[0] if lossless and rng.random() < p else pool[int(rng.integers(0, len(pool)))]
            for _ in range(table.num_layers)
        )
        out.append((f"random-{i}", layers))
    return out


def solver_plans(table: SensitivityTable, budgets: tuple[str, ...], solver: str, context_length: int,
                 ) -> list[tuple[str, tuple[LayerConfig, ...]]]:
    """The solver's plan at each budget; budgets the grid cannot meet are skipped."""
    from moend_fx.solvers import get_solver

    s = get_solver(solver)
    out = []
    for b in budgets:
        try:
            res = s.solve(table, b, context_length=context_length)
        except BudgetError:
            continue
        out.append((f"{solver}-{b}", tuple(res.plan.layers)))
    return out


def correlations(pred: list[float], meas: list[float]) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr

    if len(pred) < 3 or np.std(pred) == 0 or np.std(meas) == 0:
        return {"pearson": float("nan"), "spearman": float("nan"), "n": len(pred)}
    return {"pearson": float(pearsonr(pred, meas)[0]), "spearman": float(spearmanr(pred, meas)[0]),
            "n": len(pred)}


def predictor(table: SensitivityTable) -> str:
    """What the table's predicted loss sums, in words."""
    if table.gain is None:
        return "sum of S"
    probe = (table.calibration.get("gains") or {}).get("probe", "?")
    return f"sum of gain * S^2, per-layer gains from probe {probe}"


def spread_rows(table: SensitivityTable) -> list[dict[str, Any]]:
    """Per-layer spread (max/min over layers of S) for the paper's six columns, with the paper's value."""
    rows = []
    for name, cfg, paper in PAPER_SPREAD:
        if cfg not in table.grid.configs:
            continue
        col = table.column(cfg)
        loss = table.loss[:, table.grid.index(cfg)]
        rows.append({"name": name, "config": cfg.name, "ours": table.spread(cfg), "paper": paper,
                     "loss": None if table.gain is None else (float(loss.max() / loss.min()) if loss.min() > 0
                                                              else float("inf")),
                     "min": float(col.min()), "max": float(col.max()),
                     "argmin_layer": int(col.argmin()), "argmax_layer": int(col.argmax())})
    return rows


def heldout_tail(table: SensitivityTable, settings: ProxySettings) -> int:
    """Retrieval-tail tokens at the end of each held-out sequence: ``settings.tail``, else those the table's
    calibration sequences ended with (calibration v4: the query window, 64; none for a plain-text table), at most
    the measured continuation."""
    if settings.tail is not None:
        return settings.tail
    source = table.calibration.get("source") or {}
    tail = int(source.get("retrieval_tail_tokens") or 0) if source.get("sequences_with_tail") else 0
    return min(tail, settings.continuation)


def validate_proxy(model: Any, tokenizer: Any | None, table: SensitivityTable,
                   settings: ProxySettings | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Run the validation; returns a JSON-ready dict (see :func:`write_report`)."""
    settings = settings or ProxySettings()
    table.check_model(model)
    t0 = time.perf_counter()
    T, M = settings.tokens, settings.continuation
    tail = heldout_tail(table, settings)
    ids, source = token_sequences(model, tokenizer, settings.sequences, T + M, seed=settings.seed,
                                  split="heldout", tail=tail)
    plans = [(n, "random", p) for n, p in random_plans(table, settings.random_plans, settings.plan_seed)]
    plans += [(n, "solver", p) for n, p in solver_plans(table, settings.budgets, settings.solver, T)]
    full16 = full_cache_bytes(table.fingerprint, T)
    results = []
    for name, kind, layers in plans:
        plan = RoutingPlan(layers=layers, fingerprint=table.fingerprint, budget_bytes=1, context_length=T,
                           grid=table.grid, group_size=table.group_size)
        nbytes = plan_bytes(plan)
        results.append(PlanResult(name, kind, [c.name for c in layers], table.predicted_loss(layers), nbytes,
                                  full16 / nbytes))
    from tqdm.auto import tqdm

    bar = tqdm(total=settings.sequences * len(plans), desc="validate-proxy (sequences x plans)",
               disable=not progress)
    try:
        for s in range(settings.sequences):
            seq = ContinuationKL(model, table, ids[s], T, settings.window)
            for r, (_, _, layers) in zip(results, plans):
                r.kl_per_sequence.append(seq.kl(layers))
                bar.update(1)
            del seq
    finally:
        bar.close()
    pred = [r.predicted for r in results]
    meas = [r.measured for r in results]
    sol = [r for r in results if r.kind == "solver"]
    rnd = [r for r in results if r.kind == "random"]
    return {
        "settings": {**asdict(settings), "budgets": list(settings.budgets), "tail": tail},
        "heldout_source": source,
        "predictor": predictor(table),
        "table": {"calibration": table.calibration, "model": table.fingerprint.to_dict(),
                  "grid": table.grid.to_dict(), "group_size": table.group_size},
        "correlation": {
            "all": correlations(pred, meas),
            "solver": correlations([r.predicted for r in sol], [r.measured for r in sol]),
            "random": correlations([r.predicted for r in rnd], [r.measured for r in rnd]),
            "paper": PAPER_CORRELATION,
        },
        "spread": spread_rows(table),
        "plans": [{**asdict(r), "measured_kl": r.measured} for r in results],
        "wall_time_s": time.perf_counter() - t0,
    }
