"""`make demo`: MoE-nD end to end on the embedded SmolLM2-135M, on a CPU, in a few minutes.

calibrate (or reuse the cached table) -> solve for 14x (1/14 of a 16-bit cache) -> prepare ->
model.compile(backend="moend") -> answer a ~2k-token passkey question; prints the per-layer plan, the measured
cache memory against the full cache, and the time each step took.
"""

from __future__ import annotations

import argparse
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import moend_fx
from moend_fx.calibration.pipeline import calibrate, stale_reason
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import setting_table_path
from moend_fx.common.defaults import CALIBRATION_TOKENS, DEFAULT_MODEL
from moend_fx.common.errors import MoendError
from moend_fx.common.options import Setting
from moend_fx.compile.settings import BackendSettings, resolve_inner
from moend_fx.eval.tasks.registry import make_examples, score
from moend_fx.eviction.scorers import default_scorer
from moend_fx.models import load_model
from moend_fx.plan.memory import format_bytes, full_cache_bytes, plan_layer_bytes
from moend_fx.plan.routing import ModelFingerprint
from moend_fx.solvers import get_solver


def load_or_calibrate(model, tok, path: Path, tokens: int, scorer: str) -> SensitivityTable:
    if path.is_file():
        try:
            table = SensitivityTable.load(path)
            table.check_model(model)
            why = stale_reason(table)
            if why:
                raise MoendError(why)
            print(f"[1/5] reusing the sensitivity table {path}")
            return table
        except MoendError as e:  # stale or for another model: calibrate again
            print(f"[1/5] cached table unusable ({e}); calibrating again")
    t0 = time.perf_counter()
    print(f"[1/5] calibrating S[layer, config] on {tokens} tokens (30 layers x 54 configs, scorer {scorer}; "
          "about 40 s on 2 idle cores, several minutes when other work shares them)...", flush=True)
    table = calibrate(model, tok, tokens=tokens, scorer=scorer, progress=True)
    table.save(path)
    print(f"      done in {time.perf_counter() - t0:.1f} s, saved to {path}")
    return table


# What the first generate() after model.compile(backend="moend") waits for, measured (docs/compile.md, "Which inner
# compiler, and when compiling pays back"), by the inner compiler the backend picks for the model's device
# (inner="auto": aot_eager on CPU, inductor on CUDA). aot_eager: the trace only, the same every run.
# inductor: a cold compile fills inductor's on-disk cache, a later run reads it back.
# The whole first generate (compile + prefill + 12 tokens) with aot_eager: 110 s on 2 cores shared with other work
# (load 4-6, 2026-12-08), 65 s on 1 busy thread (issue 57); the compile alone 35 s on 2 idle cores.
FIRST_GENERATE_S = {"aot_eager": "about 35 s of compile on 2 idle cores; the whole first generate took 110 s on 2 "
                                  "cores shared with other work"}
INDUCTOR_COLD_S = {"2 idle cores": 86, "1 busy thread": 145}
INDUCTOR_WARM_S = 21
RESULTS = "docs/results.md#accuracy-vs-memory"


@contextmanager
def ticking(what: str, every_s: float = 30.0):
    """Print "still <what> (N s)" every ``every_s`` seconds until the block ends, so a long wait is never silent."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(every_s):
            print(f"      ... still {what} ({time.perf_counter() - t0:.0f} s)", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def inductor_cache_is_warm() -> bool:
    """Whether inductor's on-disk cache holds compiled code from an earlier run (then the compile is shorter)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        d = Path(cache_dir())
        return d.is_dir() and any(d.iterdir())
    except (ImportError, OSError):
        return False


def announce_compile(inner: str) -> None:
    threads = torch.get_num_threads()
    if inner == "inductor":
        what = "inductor generates and builds the decode graph's code"
        if inductor_cache_is_warm():
            guess = f"about {INDUCTOR_WARM_S} s: inductor's cache from an earlier run is warm"
        else:
            guess = ("a cold compile: " + ", ".join(f"{s} s on {k}" for k, s in INDUCTOR_COLD_S.items())
                     + "; it is paid once per process, later calls reuse the compiled graph")
    else:
        what = f"{inner} takes the graph as traced (no code generation: the shortest wait on a CPU)"
        guess = FIRST_GENERATE_S.get(inner, "a minute or less") + "; paid once per process"
    print(f"[5/5] first generate(): the prefill (eager), then torch.compile traces the decode step, the moend passes "
          f"fuse dequantize + attention, {what} ({threads} threads here; usually {guess}), then 12 new tokens",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="14x", help="budget: ratio of the 16-bit cache ('14x') or a size ('3MB')")
    ap.add_argument("--length", type=int, default=CALIBRATION_TOKENS, help="prompt length in tokens")
    ap.add_argument("--solver", default="greedy")
    ap.add_argument("--no-compile", action="store_true", help="run the eager MoENDCache path only")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()

    model, tok = load_model(DEFAULT_MODEL)
    print(f"[0/5] loaded {DEFAULT_MODEL} in {time.perf_counter() - start:.1f} s", flush=True)
    fp = ModelFingerprint.from_model(model)
    # the prompt ends with its question: the query-aware table, whose scorer reads the question's queries
    setting = Setting.QUERY_AWARE
    table = load_or_calibrate(model, tok, setting_table_path(DEFAULT_MODEL, setting), CALIBRATION_TOKENS,
                              default_scorer(setting))

    ex = make_examples("passkey", tok, args.length, 1, seed=args.seed)[0]
    ids = tok(ex.prompt_full, return_tensors="pt")
    n_prompt = ids["input_ids"].shape[1]

    max_new = 12
    t0 = time.perf_counter()
    # Solve for the whole sequence (prompt + answer): new tokens wait in each layer's full-precision
    # residual window, and the budget must hold at the end of generation too.
    result = get_solver(args.solver).solve(table, args.budget, context_length=n_prompt + max_new)
    plan = result.plan
    print(f"[2/5] {args.solver} plan for {result.budget} in {1e3 * (time.perf_counter() - t0):.1f} ms; "
          f"predicted loss {result.predicted_loss:.4f}")
    print("      layer  keep  K  V   bytes")
    for i, c in enumerate(plan.layers):
        b = plan_layer_bytes(c, n_prompt + max_new, fp, group_size=plan.group_size)
        print(f"      {i:5d}  {c.keep_ratio:4.2f} {c.k_bits:2d} {c.v_bits:2d}  {format_bytes(b)}")

    t0 = time.perf_counter()
    moend_fx.prepare(model, plan, table=table)
    print(f"[3/5] prepared in {time.perf_counter() - t0:.2f} s: model.generate() now builds a MoENDCache for "
          "this plan")
    if not args.no_compile:
        # model.compile (not torch.compile(model)): generate() calls the compiled forward. It returns at once;
        # the compile happens in the first generate().
        model.compile(backend="moend")
        inner = str(resolve_inner(BackendSettings().inner, next(model.parameters()).device.type))
        print(f"[4/5] model.compile(backend='moend'): attention over packed layers will be fused per layer; "
              f"inner compiler {inner} (the default, 'auto', for this device)")
        announce_compile(inner)
    else:
        print("[4/5] compile skipped (--no-compile)")
        print("[5/5] generate(): the prefill and 12 new tokens, eager", flush=True)

    t0 = time.perf_counter()
    with torch.inference_mode(), ticking("compiling and generating" if not args.no_compile else "generating"):
        out = model.generate(**ids, max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True)
    gen_s = time.perf_counter() - t0
    answer = tok.decode(out.sequences[0, n_prompt:], skip_special_tokens=True)
    cache = out.cache
    measured = cache.nbytes().total
    full16 = full_cache_bytes(fp, cache.get_seq_length())
    full_model = full_cache_bytes(fp, cache.get_seq_length(), dtype=None)
    ok = score(ex, answer) == 1.0
    what = "compile + prefill" if not args.no_compile else "prefill"
    print(f"      passkey at {n_prompt} tokens: expected {ex.answers[0]}, model said {answer.strip()!r} "
          f"-> {'correct' if ok else 'WRONG'} ({gen_s:.1f} s for {what} + {max_new} tokens)")
    print(f"      cache measured {format_bytes(measured)}: {full16 / measured:.1f}x smaller than a 16-bit cache "
          f"({format_bytes(full16)}), {full_model / measured:.1f}x smaller than the {fp.dtype} cache "
          f"({format_bytes(full_model)})")
    print(f"total time {time.perf_counter() - start:.1f} s")
    print(f"This cache held {full16 / measured:.1f}x less than a 16-bit one on one example; over 60-180 examples "
          f"per cell at 14x MoE-nD stays within 5 points of the full cache: {RESULTS}")


if __name__ == "__main__":
    main()
