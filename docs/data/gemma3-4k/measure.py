"""The Gemma 3 270M measurement of docs/models.md (issue 55, item 7, in part): passkey and niah_single at 4k tokens,
query-aware (the question is prefilled), the full hybrid cache (``DynamicCache``) against a greedy 14x plan (vs the
hybrid 16-bit cache; table calibrated on one 1024-token sequence), eager, one record per example and method in
records.jsonl (a rerun skips what is there). Decode ms / token is the median gap between consecutive logits calls.

    flock /tmp/moend_bench.lock .venv/bin/python docs/data/gemma3-4k/measure.py N
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.calibration.pipeline import calibrate
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.eval.tasks.base import score
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import cache_root, load_model
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.solvers import GreedySolver

OUT = Path(__file__).parent
LENGTH, NEW = 4096, 12


class Steps(LogitsProcessor):
    """Records the time of each logits call and the cache's measured bytes then."""

    def __init__(self, cache):
        self.cache, self.times, self.bytes = cache, [], []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if isinstance(self.cache, MoENDCache):
            self.bytes.append(self.cache.nbytes().total)
        return scores


def run(model, tok, ex, cache) -> dict:
    ids = tok(ex.prompt_full, return_tensors="pt").input_ids
    steps = Steps(cache)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache,
                             logits_processor=LogitsProcessorList([steps]))
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    gaps = [b - a for a, b in zip(steps.times, steps.times[1:])]
    return {"tokens": ids.shape[1], "generated": text, "answers": list(ex.answers), "score": score(ex, text),
            "prefill_s": round(steps.times[0] - t0, 2), "decode_ms": round(1e3 * statistics.median(gaps), 1),
            "max_bytes": max(steps.bytes) if steps.bytes else None}


def main(n: int) -> None:
    torch.set_num_threads(2)
    model, tok = load_model("gemma3-270m")
    path = cache_root() / "tables" / "gemma3-270m-trig-1024.safetensors"
    table = SensitivityTable.load(path) if path.is_file() else calibrate(model, tok, tokens=1024, num_sequences=1)
    if not path.is_file():
        table.save(path)
    plan = GreedySolver().solve(table, "14x", context_length=LENGTH).plan
    plan.save(OUT / "plan-14x.json")
    rec_path = OUT / "records.jsonl"
    rows = [json.loads(line) for line in rec_path.open()] if rec_path.exists() else []
    done = {(r["task"], r["index"], r["method"]) for r in rows}
    full16 = full_cache_bytes(plan.fingerprint, LENGTH)
    for i in range(n):
        for task in ("passkey", "niah_single"):
            ex = make_examples(task, tok, LENGTH, n, seed=0)[i]
            for method in ("full", "moend_14x"):
                if (task, i, method) in done:
                    continue
                if method == "full":
                    rec = run(model, tok, ex, None)
                else:
                    prepare(model, plan, table=table)
                    try:
                        cache = MoENDCache(plan, rope=rope_from_model(model), query_stats=layer_query_stats(table))
                        rec = run(model, tok, ex, cache)
                    finally:
                        unprepare(model)
                    rec.update(budget_bytes=plan.budget_bytes)
                rec.update(task=task, index=i, method=method, full16_bytes=full16)
                with rec_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
