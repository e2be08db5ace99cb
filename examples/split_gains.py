"""Per-layer gains split by kind of error: one for eviction, one for quantization (a screen, not the default).

    python examples/split_gains.py --table ~/.cache/moend/tables/smollm2-135m-trig-2048.safetensors \
        --out split.safetensors [--quant-probe keep1_k4_v4] [--evict-probe keep0.5_k16_v16]

The default table predicts a layer's loss as ``gain[l] * S[l, c] ** 2`` with one gain per layer, measured with a
probe that both evicts and quantizes (``keep0.5_k4_v4``). At keep 0.1 the L2 error S is dominated by eviction and
adds a 4-bit error in quadrature, so 4-bit K or V there costs almost nothing in the prediction, while the
evaluation's passkey misses at 4k (query-agnostic, 14x) are answered once K and V are 8-bit. If a unit of
quantization error cost more KL than a unit of eviction error, two gains would say so:

    loss[l, c] = ge[l] * Se[l, c] ** 2 + gq[l] * Sq[l, c] ** 2

with ``Se`` the S of the config's keep ratio at 16/16 bits, ``Sq ** 2 = max(S ** 2 - Se ** 2, 0)`` the rest,
``ge`` the gain of an eviction-only probe and ``gq`` that of a quantization-only probe (each measured as the
default gain is: :func:`moend_fx.calibration.gains.layer_gains` on the table's own calibration text). Written out
as a table whose S is ``sqrt(loss)`` and whose gains are 1, so ``examples/plan_ablation.py --variants
table=split.safetensors`` and the solvers read the split prediction. Prints both gains per layer and the greedy
plans of both tables at 14x for 2k and 4k prompts. Measured (docs/results.md, "What the query-agnostic 4k
passkey misses are"): the plans barely move, so it was not screened further.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from moend_fx.calibration.data import token_sequences
from moend_fx.calibration.gains import layer_gains
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text
from moend_fx.models import load_model
from moend_fx.plan.routing import Grid, LayerConfig
from moend_fx.solvers import get_solver


def split_loss(S: np.ndarray, grid: Grid, evict_gain: np.ndarray, quant_gain: np.ndarray) -> np.ndarray:
    """[L, C] ``ge * Se ** 2 + gq * Sq ** 2`` (see the module docstring).

    S: [L, C] the table's S over ``grid``'s configs (every keep ratio must have its 16/16 config);
    evict_gain, quant_gain: [L] the two gains."""
    names = {c: j for j, c in enumerate(grid.configs)}
    missing = sorted({c.keep_ratio for c in grid.configs if LayerConfig(c.keep_ratio, 16, 16) not in names})
    if missing:
        raise MoendError(f"the grid has no 16/16 config at keep ratio(s) {missing}: the eviction part of S is "
                         "unknown there; allowed: grids with every keep ratio at 16/16 bits")
    Se = S[:, [names[LayerConfig(c.keep_ratio, 16, 16)] for c in grid.configs]]
    Sq2 = np.maximum(S ** 2 - Se ** 2, 0.0)
    return np.asarray(evict_gain)[:, None] * Se ** 2 + np.asarray(quant_gain)[:, None] * Sq2


def probe_config(name: str, grid: Grid, *, quantizes: bool) -> LayerConfig:
    """The probe ``name`` if it is in ``grid`` and is of its kind (quantize-only: keep 1 with fewer than 16 bits;
    evict-only: keep < 1 at 16/16), else a MoendError."""
    c = LayerConfig.from_name(name, where="probe")
    ok = (not c.evicts and c.quantized) if quantizes else (c.evicts and not c.quantized)
    kind = "keep 1 with K or V below 16 bits" if quantizes else "keep < 1 at 16/16 bits"
    if not ok or c not in grid.configs:
        raise MoendError(f"probe {name!r} is not allowed; allowed: a config of the table's grid with {kind}")
    return c


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="a gained table (moend calibrate) of smollm2-135m")
    ap.add_argument("--out", required=True, help="the split table to write (safetensors)")
    ap.add_argument("--quant-probe", default="keep1_k4_v4")
    ap.add_argument("--evict-probe", default="keep0.5_k16_v16")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = SensitivityTable.load(args.table)
    qprobe = probe_config(args.quant_probe, table.grid, quantizes=True)
    eprobe = probe_config(args.evict_probe, table.grid, quantizes=False)
    torch.set_num_threads(args.threads)
    cal = table.calibration
    model, tok = load_model("smollm2-135m")
    table.check_model(model)
    ids, _ = token_sequences(model, tok, cal["num_sequences"], cal["tokens"], seed=cal["seed"],
                             split="calibration", tail=cal["window"], tail_sequences=cal["retrieval_tails"])
    col = {c: j for j, c in enumerate(table.grid.configs)}
    gains = {name: layer_gains(model, table, ids, probe, table.S[:, col[probe]], window=cal["window"])
             for name, probe in (("quant", qprobe), ("evict", eprobe))}
    loss = split_loss(table.S, table.grid, gains["evict"], gains["quant"])
    split = dataclasses.replace(table, S=np.sqrt(loss), gain=np.ones(table.num_layers))
    split.save(args.out)
    atomic_write_text(Path(f"{args.out}.json"), json.dumps(
        {"table": str(args.table), "quant_probe": qprobe.name, "evict_probe": eprobe.name,
         "default_gain": None if table.gain is None else table.gain.tolist(),
         **{f"{k}_gain": v.tolist() for k, v in gains.items()}}, indent=1) + "\n")
    print("layer  default gain  eviction gain  quantization gain")
    for i in range(table.num_layers):
        default = "-" if table.gain is None else f"{table.gain[i]:.4f}"
        print(f"{i:5d}  {default:>12}  {gains['evict'][i]:13.4f}  {gains['quant'][i]:17.4f}")
    for length in (2030, 4060):
        for name, t in (("default", table), ("split", split)):
            plan = get_solver("greedy").solve(t, "14x", context_length=length).plan
            print(f"14x at {length} tokens, {name}: " + " ".join(c.name for c in plan.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
