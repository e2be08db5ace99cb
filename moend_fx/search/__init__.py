"""Plan search on measured quality: an Optuna study whose objective is the continuation KL a plan really causes,
searched around the greedy and exact plans, shared by many workers through one Optuna storage.

Stages: :mod:`~moend_fx.search.objective` (the measured KL, one prefill per sequence),
:mod:`~moend_fx.search.space` (per-layer moves around the seed plans), :mod:`~moend_fx.search.study` (the study
and its workers), :mod:`~moend_fx.search.claims` (trials abandoned or told by another worker),
:mod:`~moend_fx.search.report` (greedy vs exact vs searched, held-out check, front),
:mod:`~moend_fx.search.run` (the driver the CLI calls).
"""

from moend_fx.search.objective import HeldOutText, MeasuredKL
from moend_fx.search.space import Moves, Neighbourhood
from moend_fx.search.study import (
    Objectives,
    Problem,
    SearchSampler,
    SearchSettings,
    SearchSpace,
    open_study,
    run_worker,
)

__all__ = ["HeldOutText", "MeasuredKL", "Moves", "Neighbourhood", "Objectives", "Problem", "SearchSampler",
           "SearchSettings", "SearchSpace", "open_study", "run_worker"]
