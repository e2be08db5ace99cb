"""The child side of a benchmark that measures in fresh processes (``bench prefill``, ``bench decode
--compile-times``): read the JSON spec the parent wrote, run, write the row (or the error) where it asks."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text


def child_main(spec_path: str, run: Callable[[dict[str, Any]], dict[str, Any]], *,
               any_error: bool = False) -> int:
    """Run ``run(spec)`` on the spec at ``spec_path`` and write its row to ``spec["result"]``; a MoendError (and,
    with ``any_error``, any exception: a backend that fails to compile is a result to report) becomes the row
    ``{"error": ...}``. Returns the child's exit status (2 for an error row)."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        row = run(spec)
    except MoendError as e:  # reported by the parent as one line
        row = {"error": str(e)}
    except Exception as e:
        if not any_error:
            raise
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row = {"error": f"{type(e).__name__}: {first[:300]}"}
    atomic_write_text(spec["result"], json.dumps(row, indent=1) + "\n")
    return 0 if "error" not in row else 2
