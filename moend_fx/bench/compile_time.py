"""Cold and warm compile time of the decode graph (``moend bench decode --compile-times``).

For each compiled method (``moend_compiled``: ``model.compile(backend="moend")`` over a MoENDCache;
``full_inductor``: ``model.compile()`` over a ``DynamicCache``) two fresh Python processes
(``python -m moend_fx.bench.compile_time SPEC``, the pattern of :mod:`moend_fx.bench.prefill`) run one after the
other with ``TORCHINDUCTOR_CACHE_DIR`` set to the same new, empty temporary directory:

* **cold**: the first process finds the directory empty: dynamo traces, the backend's passes run, inductor
  generates and builds every kernel;
* **warm**: the second finds what the first left (inductor's FX graph cache, the AOTAutograd cache, built
  kernels): dynamo still traces in the new process, the rest is read back.

In each child: load the model, set it up as the decode benchmark does (:func:`moend_fx.bench.decode_run.setup_model`:
the same plan, greedy on the table or uniform, for the context length), prefill ``length - steps - 1`` random
tokens eagerly, then run ``1 + steps`` decode steps and time each. The first step compiles, and a step may
recompile (``full_inductor``'s second step does: the cache's length changed, dynamo makes it dynamic), so
``compile_s`` = the sum over the steps of their time above the median of the last ``steps`` steps. Also
reported: the graphs dynamo compiled and inductor's and AOTAutograd's cache counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moend_fx.bench.child import child_main
from moend_fx.bench.decode_settings import DecodeBenchSettings
from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text

COMPILED: dict[str, str] = {"full_inductor": "inductor", "moend_compiled": "moend"}
PHASES: tuple[str, ...] = ("cold", "warm")


def bench_compile_times(model_name: str, settings: DecodeBenchSettings, *, length: int,
                        methods: tuple[str, ...] = ("moend_compiled",), table: str | None = None,
                        plan: str | None = None, threads: int = 1, steps: int = 4) -> dict[str, Any]:
    """Cold then warm compile of each method in ``methods`` (those of :data:`COMPILED`) at context ``length``;
    ``{"tokens", "threads", "steps", "rows"}``, one row per (method, phase). model_name: an embedded model
    name or an HF folder; table, plan: file paths (as ``moend bench decode`` takes them)."""
    bad = [m for m in methods if m not in COMPILED]
    if bad or not methods:
        raise MoendError(f"compile-time methods {list(methods)} are invalid; allowed: one or more of "
                         f"{', '.join(COMPILED)}")
    check_int("compile-time length", length, minimum=steps + 2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moend-compile-") as tmp:
        work = Path(tmp)
        for method in methods:
            inductor_dir = work / f"inductor-{method}"  # new and empty: the cold run fills it, the warm one reads it
            inductor_dir.mkdir()
            for phase in PHASES:
                spec = {"model": model_name, "method": method, "phase": phase, "length": length, "steps": steps,
                        "threads": threads, "settings": settings.to_dict(), "table": table, "plan": plan,
                        "result": str(work / f"{method}-{phase}.json")}
                rows.append(_run_child(spec, work, inductor_dir))
    return {"tokens": length, "threads": threads, "steps": steps, "rows": rows}


def _run_child(spec: dict[str, Any], work: Path, inductor_dir: Path) -> dict[str, Any]:
    """One phase in a fresh process with ``TORCHINDUCTOR_CACHE_DIR=inductor_dir``; its row (a failed child gives
    a row with ``error``)."""
    print(f"bench decode: {spec['phase']} compile of {spec['method']} in a fresh process", file=sys.stderr,
          flush=True)
    path = atomic_write_text(work / f"{spec['method']}-{spec['phase']}.spec.json", json.dumps(spec) + "\n")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moend_fx.bench.compile_time", str(path)], check=False, env=env)
    result = Path(spec["result"])
    if result.is_file():
        row = json.loads(result.read_text())
    else:
        row = {"error": f"the child process died (exit code {proc.returncode}; its output is above)"}
    return dict(row, method=spec["method"], phase=spec["phase"], process_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------- child


@torch.no_grad()
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One phase in this (fresh) process: set up, prefill, time ``1 + steps`` decode steps; the row."""
    from torch._dynamo.utils import counters

    from moend_fx.bench import decode_run as run
    from moend_fx.bench.decode import plan_for_length
    from moend_fx.cache.generation import decode_compile_settings
    from moend_fx.calibration.tables import load_table
    from moend_fx.models import load_model
    from moend_fx.plan.routing import RoutingPlan

    torch.set_num_threads(spec["threads"])
    settings = DecodeBenchSettings.from_dict(spec["settings"])
    model = load_model(spec["model"])[0]
    table = load_table(spec["table"]) if spec["table"] else None
    n, method = spec["length"], spec["method"]
    m = run.DecodeMethod(method, method.startswith("moend"), COMPILED[method])
    if m.moend:
        given = RoutingPlan.load(spec["plan"]) if spec["plan"] else None
        m.plans[n] = plan_for_length(model, n, settings, table=table, plan=given)[0]
    run.setup_model(model, m, settings, table)
    ids = torch.randint(0, model.config.vocab_size, (1, n - spec["steps"] - 1),
                        generator=torch.Generator().manual_seed(settings.seed + n))
    cache = run.new_cache(model, m, n, table, settings)
    tok = model.forward(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    times: list[float] = []
    with decode_compile_settings() if m.moend else contextlib.nullcontext():
        run.decode_steps(model, cache, tok, 1 + spec["steps"], times)
    run.teardown_model(model)
    steady = statistics.median(times[1:])
    from moend_fx.passes import pass_seconds

    return {"tokens": n, "first_step_s": times[0], "steady_step_s": steady, "passes_s": pass_seconds(),
            "compile_s": sum(max(0.0, t - steady) for t in times),
            "step_s": times, "graphs": int(counters["stats"]["unique_graphs"]),
            "inductor_counters": {k: int(v) for k, v in counters["inductor"].items() if "cache" in k},
            "aot_autograd_counters": {k: int(v) for k, v in counters["aot_autograd"].items() if "cache" in k},
            "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "threads": torch.get_num_threads()}


def _child_main(spec_path: str) -> int:
    return child_main(spec_path, run_child, any_error=True)  # a failed compile is a row, as decode rows are


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
