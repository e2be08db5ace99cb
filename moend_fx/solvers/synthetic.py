"""Synthetic sensitivity tables shaped like the paper's, for tests and studies before a real table exists.

``S[l, (keep, kb, vb)] = e_l * f(keep) + k_l(kb) + v_l(vb)``, zero for the lossless config. The per-layer
factors are log-uniform with the paper's spreads (max/min across layers): eviction ~600x, K8 87x, K4 15x,
V8 1.6x, V4 1.2x. So eviction routing matters most, K bits moderately, V bits barely: as in the paper.
"""

from __future__ import annotations

import numpy as np

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.defaults import CALIBRATION_TOKENS, GROUP_SIZE
from moend_fx.common.options import ScorerName
from moend_fx.plan.fingerprint import ModelFingerprint
from moend_fx.plan.grid import Grid

# (median factor, max/min spread across layers) per component; medians put S in the range of a relative L2
# error of an attention output (evict 90% ~0.1-0.5 on sensitive layers, K8 ~0.01, V4 ~0.1).
_SPREADS = {"evict": (0.02, 600.0), "k8": (0.004, 87.0), "k4": (0.06, 15.0), "v8": (0.006, 1.6),
            "v4": (0.09, 1.2), "k2": (0.4, 8.0), "v2": (0.35, 1.1)}


def _log_uniform(rng: np.random.Generator, n: int, median: float, spread: float) -> np.ndarray:
    """n factors whose max/min is exactly ``spread`` (when n >= 2) around ``median``."""
    u = rng.uniform(0.0, 1.0, n)
    if n >= 2:
        u[rng.choice(n, 2, replace=False)] = (0.0, 1.0)
    return median * spread ** (u - 0.5)


def synthetic_fingerprint(num_layers: int) -> ModelFingerprint:
    """SmolLM2-135M's shapes (3 KV heads, head_dim 64, 9 heads, fp32) with ``num_layers`` layers."""
    return ModelFingerprint("LlamaForCausalLM", num_layers, 3, 64, 9, "float32")


def synthetic_table(num_layers: int, grid: Grid | None = None, seed: int = 0,
                    fingerprint: ModelFingerprint | None = None, context_length: int = CALIBRATION_TOKENS
                    ) -> SensitivityTable:
    """A random paper-shaped table: S [num_layers, len(grid)] float64, 0 for keep=1.0 / 16 / 16."""
    grid = grid or Grid()
    fp = fingerprint or synthetic_fingerprint(num_layers)
    if fp.num_layers != num_layers:
        raise ValueError(f"fingerprint has num_layers={fp.num_layers}, expected {num_layers}")
    rng = np.random.default_rng(seed)
    f = {name: _log_uniform(rng, num_layers, *ms) for name, ms in _SPREADS.items()}
    # Eviction error grows faster than linearly as keep shrinks (the last tokens dropped matter most).
    evict = {k: (1.0 - k) ** 1.5 / 0.9 ** 1.5 for k in grid.keep_ratios}
    k_err = {16: np.zeros(num_layers), 8: f["k8"], 4: np.maximum(f["k4"], 2 * f["k8"]),
             2: np.maximum(f["k2"], 2 * np.maximum(f["k4"], 2 * f["k8"]))}
    v_err = {16: np.zeros(num_layers), 8: f["v8"], 4: np.maximum(f["v4"], 2 * f["v8"]),
             2: np.maximum(f["v2"], 2 * np.maximum(f["v4"], 2 * f["v8"]))}
    cols = [f["evict"] * evict[c.keep_ratio] + k_err[c.k_bits] + v_err[c.v_bits] for c in grid.configs]
    S = np.stack(cols, axis=1).astype(np.float64)
    return SensitivityTable(S=S, grid=grid, fingerprint=fp, group_size=GROUP_SIZE,
                            calibration={"synthetic": True, "seed": seed, "scorer": str(ScorerName.TRIG),
                                         "context_length": context_length})
