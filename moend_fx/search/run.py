"""The driver shared by ``moend search`` and ``moend compare-solvers --measured-trials``: prefill the text once,
then for each budget open (or join) its study, run a worker to the study's total and summarise."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.search import report
from moend_fx.search.objective import held_out_objectives
from moend_fx.search.study import Problem, SearchSettings, open_study, run_worker


def search_budgets(model: Any, tokenizer: Any | None, table: SensitivityTable, settings: SearchSettings,
                   budgets: Sequence[str], *, storage: Any, study: str | None = None, check: bool = True,
                   progress: bool = True) -> dict[str, Any]:
    """Search each budget (``settings.budget`` replaced by each of ``budgets``) on one prefilled text.

    ``study``: the study name at one budget, or a prefix (``NAME-<budget>``) at several; None derives a name
    from the problem. Returns ``{"text", "budgets": [summary...], "points", "workers", "prefill_s"}``.
    """
    from tqdm.auto import tqdm

    table.check_model(model)
    t0 = time.perf_counter()
    n_check = settings.text.check if check else 0
    with tqdm(total=settings.text.search + n_check, desc="prefill held-out text", unit="seq",
              disable=not progress) as bar:
        search, held, source = held_out_objectives(model, tokenizer, table, settings.text, check=check,
                                                   progress=lambda i, n: bar.update(1))
    summaries, points, workers = [], {}, []
    for b in budgets:
        s = dataclasses.replace(settings, budget=str(b))
        problem = Problem.of(table, s)
        name = study if (study is None or len(budgets) == 1) else f"{study}-{b}"
        st, desc = open_study(storage, name, problem, s)
        with tqdm(total=s.trials, desc=f"search {b}", unit="trial", disable=not progress) as bar:
            def on_trial(n: int, best: float, bar: Any = bar) -> None:
                bar.n = n
                bar.set_postfix(best_kl=f"{best:.4f}")
                bar.refresh()

            rep = run_worker(st, problem, search, s, on_trial=on_trial)
        workers.append({"budget": str(b), "storage": desc, **dataclasses.asdict(rep)})
        summaries.append(report.summarise(st, problem, table.grid.configs, held=held, budget=str(b)))
        points[str(b)] = report.trial_points(st)
    text = {**settings.text.to_dict(), "check": n_check, "source": source}
    return {"text": text, "budgets": summaries, "points": points, "workers": workers,
            "prefill_s": search.prefill_s, "wall_s": time.perf_counter() - t0}

