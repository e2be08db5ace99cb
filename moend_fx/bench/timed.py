"""A timed section of a benchmark on a shared machine: an exclusive ``flock`` on a lock file that every timed run
takes (so two timed runs never overlap), held only while the section runs; the untimed work around it (a long
prefill) runs without the lock, and at the process's own priority: a run started under ``nice`` lets the timed
runs of others go first, and its own timed sections run at priority 0 (raised for every thread of the process,
lowered back after; raising needs the right to, else the section runs at the inherited priority and says so)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def _threads() -> list[int]:
    """Thread ids of this process (Linux; else just the process)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_priority(value: int) -> bool:
    """Every thread's nice value to ``value``; False where the system refuses (no right to raise it)."""
    try:
        for tid in _threads():
            os.setpriority(os.PRIO_PROCESS, tid, value)
    except (PermissionError, ProcessLookupError):
        return False
    return True


@contextlib.contextmanager
def timed_section(lock: str | Path | None, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold ``lock`` (an exclusive flock; None: no lock, no priority change) at nice 0 for the block."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        raised = nice <= 0 or _set_priority(0)
        log(f"lock {lock} held after {time.perf_counter() - t0:.0f} s of waiting"
            + ("" if raised else f"; timed at the inherited nice {nice} (no right to raise it)"))
        try:
            yield
        finally:
            if nice > 0 and raised:
                _set_priority(nice)
            fcntl.flock(f, fcntl.LOCK_UN)
