"""Reading a stopped run's records (``records.jsonl``) back, checked line by line: no torch, so that pooling
runs (``moend report``) needs none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError

RUN_FIELDS = ("task", "target_length", "index", "setting", "method", "budget")
"""The fields a resumed evaluation keys its runs on."""


def load_records(path: Path, fields: tuple[str, ...] = RUN_FIELDS,
                 restart: str = "pass --no-resume to start over") -> list[dict[str, Any]]:
    """The records of a stopped run (``records.jsonl``), each checked for the ``fields`` resuming keys on (an
    evaluation's by default); a line that is not a JSON record, or lacks one of them, is a MoendError naming the
    file and the line, and saying how to start over (``restart``)."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise MoendError(f"{path}:{i} is not a JSON record ({e.msg}); fix or delete the file, or "
                             f"{restart}") from None
        missing = [k for k in fields if not isinstance(r, dict) or k not in r]
        if missing:
            raise MoendError(f"{path}:{i} lacks {', '.join(missing)} (a record of another version?); {restart}, "
                             "or write to another --out")
        out.append(r)
    return out
