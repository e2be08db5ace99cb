"""Offline RULER-style long-context tasks (passkey, NIAH variants, variable tracking, common words).

``registry``: names -> task configs and ``make_examples``; ``base``: the Example and scoring; one module per
task family (``retrieval``, ``aggregate``) and the filler text they share (``text``)."""

from moend_fx.eval.tasks.registry import (
    SETTINGS,
    TASKS,
    Example,
    candidates,
    depths_for,
    get_task,
    make_examples,
    score,
)

__all__ = ["SETTINGS", "TASKS", "Example", "candidates", "depths_for", "get_task", "make_examples", "score"]
