"""Where an Optuna study lives: storage specs (RDB URL, journal file, in-memory) and the key that names a
problem, so a study shared by several processes or machines is never fed trials of another problem."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.common.errors import MoendError

_RDB_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_OPEN_ATTEMPTS = 5


def problem_key(S: np.ndarray, B: np.ndarray, budget: int, space: str) -> str:
    """A short hash naming the problem, so a shared study is never fed trials of another problem."""
    h = hashlib.sha256()
    for a in (np.ascontiguousarray(S, dtype=np.float64), np.ascontiguousarray(B, dtype=np.int64)):
        h.update(a.tobytes())
        h.update(str(a.shape).encode())
    h.update(f"{budget}|{space}".encode())
    return h.hexdigest()[:16]


def storage_error(desc: str, e: BaseException, lock_timeout: float | None = None) -> MoendError:
    """A one-line error for a storage that cannot be read: locked, corrupted or unreachable (SQLAlchemy's own
    messages run over several lines and end in a URL)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    low = first.lower()
    if "locked" in low or "busy" in low:
        waited = f" (waited {lock_timeout:g} s)" if lock_timeout is not None else ""
        return MoendError(f"optuna storage {desc!r} is locked by another process{waited}; wait for it, or raise "
                          "--lock-timeout")
    if isinstance(e, (ValueError, KeyError)) or "not a database" in low or "malformed" in low:
        return MoendError(f"optuna storage {desc!r} is corrupted or not an optuna storage ({first}); move it "
                          "away and start a new study")
    return MoendError(f"optuna storage {desc!r} cannot be used: {first}")


def resolve_storage(storage: Any, tmpdir: str | None, lock_timeout: float = 120.0) -> tuple[Any, str]:
    """(what ``optuna.create_study`` takes, a description). See the module docstring for accepted forms.
    lock_timeout: seconds an SQLite writer waits for another process's lock before failing."""
    import optuna

    if storage is None:
        assert tmpdir is not None
        storage = f"sqlite:///{Path(tmpdir) / 'optuna.db'}"
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage, type(storage).__name__
    if not isinstance(storage, (str, os.PathLike)):
        raise MoendError(f"optuna storage {storage!r} is not a storage URL or path; allowed: an RDB URL "
                         "('sqlite:///study.db', 'postgresql://...'), a journal file path, or ':memory:'")
    s = str(storage)
    if s in (":memory:", "memory"):
        return optuna.storages.InMemoryStorage(), "in-memory"
    if "://" in s:
        kw: dict[str, Any] = {}
        if s.startswith("sqlite"):
            # Several processes write one SQLite file: wait for the lock instead of failing at once.
            kw["engine_kwargs"] = {"connect_args": {"timeout": lock_timeout}}
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(s, **kw), _redact(s)
            except Exception as e:  # bad dialect, unreachable server, missing driver, schema race...
                # Workers that start together race to create the schema; the loser sees an integrity error
                # and succeeds on retry once the winner is done.
                if attempt == _OPEN_ATTEMPTS - 1 or "locked" in str(e):
                    raise storage_error(_redact(s), e, lock_timeout) from None
                time.sleep(0.2 * (attempt + 1))
    path = Path(s)
    if path.suffix in _RDB_SUFFIXES:
        return resolve_storage(f"sqlite:///{path.resolve()}", None, lock_timeout)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # the journal is replayed here: a torn or foreign file fails now
        backend = optuna.storages.journal.JournalFileBackend(str(path))
        return optuna.storages.JournalStorage(backend), f"journal:{path}"
    except Exception as e:
        raise storage_error(f"journal:{path}", e, lock_timeout) from None


def _redact(url: str) -> str:
    """Hide a password in ``scheme://user:password@host``."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url
