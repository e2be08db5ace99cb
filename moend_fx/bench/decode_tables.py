"""The decode benchmark's Markdown beyond its main table: throughput by batch, the cache's check against the
memory model, the largest batch under a memory cap, cold and warm compile times."""

from __future__ import annotations

from typing import Any

from moend_fx.plan.memory import format_bytes


def _ok(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["status"] == "ok"]


def batch_table(result: dict[str, Any]) -> list[str]:
    """Every row (batch 1 included, for reference) when more than one batch size ran; else nothing."""
    rows = result["rows"]
    if len({r.get("batch", 1) for r in rows}) < 2:
        return []
    base = result["meta"]["baseline"]
    lines = ["", f"Throughput by batch: one decode step advances every row of the batch by one token; tokens/s = "
             f"batch / step time; speed-up = method tokens/s / {base} tokens/s at the same context and batch. "
             "Cache = measured bytes of the whole batch after the last step.", "",
             "| method | context | batch | ms/step | tokens/s | speed-up | cache | cache / sequence |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["method"], r.get("batch", 1))):
        head = f"| {r['method']} | {r['tokens']} | {r.get('batch', 1)} |"
        if r["status"] != "ok":
            lines.append(f"{head} unavailable: {r['reason']} | | | | |")
            continue
        sp = r.get("speedup_vs_baseline")
        lines.append(f"{head} {r['ms_median']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{'' if sp is None else f'{sp:.2f}x'} | {format_bytes(r['cache_bytes'])} | "
                     f"{format_bytes(r['cache_bytes'] / r.get('batch', 1))} |")
    return lines


def cache_check(result: dict[str, Any]) -> list[str]:
    """One sentence: how many rows' measured cache bytes equal the memory model and stay within its bound."""
    rows = [r for r in _ok(result) if "model_cache_bytes" in r]
    if not rows:
        return []
    same = sum(r["cache_matches_model"] for r in rows)
    within = sum(r["cache_within_bound"] for r in rows)
    text = (f"Memory-model check (measured after the last step, every batch size): the cache's bytes equal the "
            f"memory model's count of what it holds in {same}/{len(rows)} rows and stay within the model's bound "
            f"(full cache: `full_cache_bytes`; MoENDCache: `plan_bytes` of its plan) in {within}/{len(rows)}.")
    off = [r for r in rows if not (r["cache_matches_model"] and r["cache_within_bound"])]
    if off:
        text += " Off: " + "; ".join(
            f"{r['method']} @ {r['tokens']} x{r['batch']}: measured {r['cache_bytes']} B, model "
            f"{r['model_cache_bytes']} B, bound {r['cache_bound_bytes']} B" for r in off[:4])
    return ["", text]


def fit_table(result: dict[str, Any]) -> list[str]:
    """The largest batch of each method under the memory cap (predicted, never measured)."""
    fit = result.get("fit")
    if not fit:
        return []
    cap = fit[0]["cap_bytes"]
    lines = ["", f"Largest batch under a {format_bytes(cap)} memory cap, **{fit[0]['basis']}**: the largest B with "
             "weights + cache(B) + B x workspace <= cap. Cache: `full_cache_bytes` in the model's dtype, or the "
             "MoENDCache plan's `plan_bytes` (capacity mode never holds more). Workspace per sequence (stated from "
             "the shapes): one step's logits, activations, fp32 attention scores, and one layer's K/V copied by "
             "DynamicCache's `torch.cat` (full) or dequantized (moend_eager); none for the fused op "
             "(moend_compiled). The runtime, compiled code and the prefill's activations are not counted.", "",
             "| method | context | weights | cache / sequence | workspace / sequence | largest batch | "
             "total at that batch |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in fit:
        total = "" if f["bytes_at_largest_batch"] is None else format_bytes(f["bytes_at_largest_batch"])
        lines.append(f"| {f['method']} | {f['tokens']} | {format_bytes(f['weight_bytes'])} | "
                     f"{format_bytes(f['cache_bytes_per_sequence'])} | "
                     f"{format_bytes(f['workspace_bytes_per_sequence'])} | {f['largest_batch']} | {total} |")
    return lines


def compile_table(result: dict[str, Any]) -> list[str]:
    """Cold and warm compile time per compiled method (each run in a fresh process)."""
    ct = result.get("compile_times")
    if not ct:
        return []
    lines = ["", f"Compile time of the decode graph, each phase in a fresh process at context {ct['tokens']} "
             f"({ct['threads']} threads): cold = an empty `TORCHINDUCTOR_CACHE_DIR`, warm = a second process with "
             "the same directory. Compile = the decode steps' time above the median of the later steps (the first "
             "step compiles; a step may recompile). FX cache = inductor's FX graph cache hits / misses in that "
             "process. Passes = the time the `moend` backend's own FX passes took within the compile.", "",
             "| method | phase | compile | of which passes | first step | later steps (median) | graphs | "
             "FX cache hit / miss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ct["rows"]:
        head = f"| {r['method']} | {r['phase']} |"
        if r.get("error"):
            lines.append(f"{head} failed: {r['error']} | | | | | |")
            continue
        fx = r.get("inductor_counters", {})
        passes = sum(r.get("passes_s", {}).values())
        lines.append(f"{head} {r['compile_s']:.1f} s | {passes:.2f} s | {r['first_step_s']:.1f} s | "
                     f"{r['steady_step_s'] * 1e3:.1f} ms | {r['graphs']} | {fx.get('fxgraph_cache_hit', 0)} / "
                     f"{fx.get('fxgraph_cache_miss', 0)} |")
    return lines


def recompile_note(result: dict[str, Any]) -> list[str]:
    """A sentence naming the rows whose measured steps compiled a graph (left out of their median)."""
    hit = [r for r in _ok(result) if r.get("compiled_steps")]
    if not hit:
        return []

    def one(r: dict[str, Any]) -> str:
        where = f"{r['method']} @ {r['tokens']}" + ("" if r.get("batch", 1) == 1 else f" x{r['batch']}")
        every = " (every step: its median includes compilation)" if r["compiled_steps"] >= r["steps"] else ""
        return (f"{where}: {r['compiled_steps']} of {r['steps']} steps{every}, "
                f"{r.get('graphs_compiled', '?')} graphs in warm-up and measurement")
    return ["", "Measured steps that compiled a graph (a recompile the warm-up did not absorb) are left out of the "
            "median: " + "; ".join(one(r) for r in hit) + ". Raise `--warmup` to keep them out of the measurement."]
