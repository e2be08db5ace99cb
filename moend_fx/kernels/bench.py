"""Micro-benchmark of one decode attention call over a compressed layer (``python -m moend_fx.kernels.bench``).

q: [1, 9, 1, 64] over 3 KV heads (SmolLM2's shapes) at several held lengths, for
* ``sdpa_fp32``: torch SDPA on dense fp32 K/V (the baseline),
* ``reference_k{b}v{b}``: dequantize the layer with torch ops, then SDPA,
* ``cpu_k{b}v{b}``: the fused C++ kernel (16 = stored as fp16, 8, 4 bits).

Each method gets its own set of copies of the inputs, used in rotation, so that every call reads its
K/V from memory rather than from a cache warmed by the previous call (design.md). Median of ``runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.io import atomic_write_text
from moend_fx.kernels import cpu
from moend_fx.kernels.ops import packed_attention
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

ROTATE_BYTES = 96 * 2**20  # more than the last-level cache, so rotated copies come from DRAM


def _time(fn: Callable[[int], object], copies: int, runs: int) -> float:
    for i in range(min(copies, 3)):
        fn(i)
    times = []
    for r in range(runs):
        t0 = time.perf_counter()
        fn(r % copies)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_decode(
    lengths: tuple[int, ...] = (2048, 8192, 32768), runs: int = 30, heads: int = 9, kv_heads: int = 3,
    head_dim: int = 64, bits: tuple[int, ...] = (16, 8, 4), group_size: int = GROUP_SIZE, seed: int = 0,
) -> list[dict]:
    """Median ms per call for each method and length; rows of {method, tokens, ms, ratio_vs_sdpa, bytes}."""
    g = torch.Generator().manual_seed(seed)
    rows: list[dict] = []
    q = torch.randn(1, heads, 1, head_dim, generator=g)
    scale = 1.0 / math.sqrt(head_dim)
    for n in lengths:
        dense_bytes = 2 * kv_heads * n * head_dim * 4
        copies = max(2, math.ceil(ROTATE_BYTES / dense_bytes))
        ks = [torch.randn(1, kv_heads, n, head_dim, generator=g) for _ in range(copies)]
        vs = [torch.randn(1, kv_heads, n, head_dim, generator=g) for _ in range(copies)]
        def sdpa(i, ks=ks, vs=vs):
            return F.scaled_dot_product_attention(q, ks[i], vs[i], scale=scale, enable_gqa=True)

        sdpa_ms = _time(sdpa, copies, runs)
        rows.append({"method": "sdpa_fp32", "tokens": n, "ms": sdpa_ms, "bytes": dense_bytes})
        for b in bits:
            layers = [PackedKV.from_dense(ks[i], vs[i], LayerConfig(1.0, b, b), group_size) for i in range(copies)]
            nbytes = layers[0].nbytes()
            if b != 16:
                def ref(i, layers=layers):
                    k, v = layers[i].dequantize(torch.float32)
                    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

                rows.append({"method": f"reference_k{b}v{b}", "tokens": n, "ms": _time(ref, copies, runs),
                             "bytes": nbytes})
            if cpu.available():
                ms = _time(lambda i, layers=layers: packed_attention(q, layers[i], kernel="cpu"), copies, runs)
                rows.append({"method": f"cpu_k{b}v{b}", "tokens": n, "ms": ms, "bytes": nbytes})
            del layers
    base = {r["tokens"]: r["ms"] for r in rows if r["method"] == "sdpa_fp32"}
    for r in rows:
        r["ratio_vs_sdpa"] = r["ms"] / base[r["tokens"]]
        r["gb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = [f"Decode attention, q 1x9x1x64, 3 KV heads, {torch.get_num_threads()} threads, median ms "
             "(ratio = time / fp32 SDPA time; < 1 is faster)", "",
             "| method | tokens | ms | ratio vs SDPA | bytes read | GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['tokens']} | {r['ms']:.3f} | {r['ratio_vs_sdpa']:.2f} | "
                     f"{r['bytes']} | {r['gb_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--out", default="bench_kernels", help="output prefix: writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench_decode(tuple(int(x) for x in args.lengths.split(",")), runs=args.runs)
    md = to_markdown(rows)
    atomic_write_text(Path(args.out + ".json"), json.dumps(rows, indent=1))
    atomic_write_text(Path(args.out + ".md"), md)
    print(md)


if __name__ == "__main__":
    main()
