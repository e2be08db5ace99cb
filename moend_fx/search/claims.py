"""Which worker holds which trial of a shared study: trials a dead worker left running, and trials another
worker told first."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def fail_abandoned(study: Any) -> int:
    """Fail trials left RUNNING by a worker of this host that is no longer alive; returns how many."""
    import optuna

    host, n = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        w_host, _, pid = str(t.user_attrs.get("worker", "")).partition(":")
        if w_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Duplicate(Exception):
    """This worker's trial was told by another worker first."""


@contextmanager
def told_elsewhere(study: Any, number: int) -> Iterator[None]:
    """Turn a write refused because trial ``number`` is already finished into :class:`Duplicate`.

    SQLite ignores the row lock optuna takes to pop an enqueued trial, so under load two workers can be handed
    the same seeded trial; the first to finish tells it (the same plan's KL is the same). The second learns it
    when it suggests the plan's parameters (its cached view missed the other's) or when it tells the result."""
    import optuna

    try:
        yield
    except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
        if not finished(study, number):
            raise
        raise Duplicate from None


def finished(study: Any, number: int) -> bool:
    """Whether trial ``number`` of ``study`` is already finished (told by another worker)."""
    return any(t.number == number and t.state.is_finished() for t in study.get_trials(deepcopy=False))
