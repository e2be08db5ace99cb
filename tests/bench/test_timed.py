"""moend_fx.bench.timed: the lock is held exclusively inside the section only, and the process's priority is what
it was once the section ends."""

from __future__ import annotations

import fcntl
import os

import pytest

from moend_fx.bench.timed import timed_section


def _free(path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_the_lock_is_held_inside_the_section_only(tmp_path):
    lock, said = tmp_path / "bench.lock", []
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    with timed_section(str(lock), said.append):
        assert not _free(lock)  # another open file description cannot take it meanwhile
    assert _free(lock) and os.getpriority(os.PRIO_PROCESS, 0) == nice
    assert said and said[0].startswith(f"lock {lock} held after")
    with timed_section(None, said.append):  # no lock: nothing taken, nothing said
        assert _free(lock)
    assert len(said) == 1


def test_the_lock_is_released_when_the_section_fails(tmp_path):
    lock = tmp_path / "bench.lock"
    with pytest.raises(RuntimeError), timed_section(str(lock), lambda s: None):
        raise RuntimeError("a failing benchmark")
    assert _free(lock)
