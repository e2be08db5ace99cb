"""What machine a measurement ran on: results record it, since fp32 kernels differ across CPUs.

Two runs of the same code on two CPUs can answer an evaluation example differently: at 8k tokens the full
cache's query-aware answers on SmolLM2 differ in 5 of 20 examples between records made on 2026-12-03 and a run of
2026-12-07 on an AMD EPYC (docs/results.md, "The full cache in the same run").
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows (``"unknown"`` if nothing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
