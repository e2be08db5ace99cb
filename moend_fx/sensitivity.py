"""Per-layer sensitivity table S[layer, config] (MoE-nD's offline calibration result).

STUB by the lead: the calibration issue fills in save/load (safetensors + JSON metadata) and validation.
The fields and ``bytes_matrix`` are the contract the solvers use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moend_fx.memory import plan_layer_bytes
from moend_fx.plan import Grid, ModelFingerprint


@dataclass(frozen=True)
class SensitivityTable:
    """``S[l, c]``: relative L2 error of layer l's attention output under ``grid.configs[c]`` alone.

    S: [L, C] float64, L = fingerprint.num_layers, C = len(grid).
    """

    S: np.ndarray
    grid: Grid
    fingerprint: ModelFingerprint
    group_size: int = 32
    calibration: dict[str, Any] = field(default_factory=dict)
    query_stats: dict[str, np.ndarray] = field(default_factory=dict)

    def bytes_matrix(self, context_length: int, batch: int = 1) -> np.ndarray:
        """[L, C] int64: bytes each config takes on each layer at ``context_length`` tokens."""
        row = np.array(
            [plan_layer_bytes(c, context_length, self.fingerprint, group_size=self.group_size, batch=batch)
             for c in self.grid.configs],
            dtype=np.int64,
        )
        return np.tile(row, (self.fingerprint.num_layers, 1))
