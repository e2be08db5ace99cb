"""Micro-benchmark of one decode attention call over a compressed layer (``python -m moend_fx.kernels.bench``).

q: [1, 9, 1, 64] over 3 KV heads (SmolLM2's shapes) at several held lengths, at 1 thread and at the current
thread count (``torch.get_num_threads()``, e.g. 2), in one run, for
* ``sdpa_fp32``: torch SDPA on dense fp32 K/V of the same tokens (the baseline),
* ``reference_k{b}v{b}``: dequantize the layer with torch ops, then SDPA,
* ``cpu_k{b}v{b}``: the fused C++ kernel (16 = stored as fp16, 8, 4, 2 bits).

Each method gets its own set of copies of the inputs, used in rotation, so that every call reads its
K/V from memory rather than from a cache warmed by the previous call (design.md). Median of ``runs``.
``gb_per_s`` is the bytes the method reads (dense fp32 for SDPA; the compressed layer, scales and residual
included, for the others) over its time; ``x_vs_sdpa`` is SDPA's time over the method's at the same thread
count; ``x_vs_1_thread`` the method's 1-thread time over its time at this row's thread count.
``stream_gb_per_s`` is what this host reads at that thread count in the same run (``torch.sum`` over a
``STREAM_BYTES`` fp32 tensor, median of ``STREAM_RUNS``) and ``of_stream`` the row's share of it: GB/s figures
move with the host (2x between VMs of one kind), the share much less.
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
DEFAULT_LENGTHS = (8192, 32768, 131072)
DEFAULT_BITS = (16, 8, 4, 2)
REFERENCE_MAX_TOKENS = 32768  # dequantize + SDPA is 10-30x slower: timed only up to here
STREAM_BYTES = 512 * 2**20  # 16x the last-level cache: a sum over it reads DRAM
STREAM_RUNS = 7


def _time(fn: Callable[[int], object], copies: int, runs: int) -> float:
    for i in range(min(copies, 3)):
        fn(i)
    times = []
    for r in range(runs):
        t0 = time.perf_counter()
        fn(r % copies)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def stream_read_gbs(nbytes: int = STREAM_BYTES, runs: int = STREAM_RUNS) -> float:
    """GB/s that ``torch.sum`` reads from an fp32 tensor of ``nbytes`` at the current thread count (median of
    ``runs``): the host's streaming read rate, the ceiling a memory-bound kernel is read against."""
    x = torch.rand(max(1, nbytes // 4))
    ms = _time(lambda i: x.sum(), 1, runs)
    return x.numel() * 4 / (ms * 1e-3) / 1e9


def _methods(q: torch.Tensor, ks: list, vs: list, layers: dict[int, list[PackedKV]], n: int) -> list[tuple]:
    """(method, bytes read, fn(copy index)) for every method at one length."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out: list[tuple] = [("sdpa_fp32", 2 * ks[0].numel() * 4,
                         lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], scale=scale, enable_gqa=True))]
    for b, ls in layers.items():
        if b != 16 and n <= REFERENCE_MAX_TOKENS:
            def ref(i, ls=ls):
                k, v = ls[i].dequantize(torch.float32)
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            out.append((f"reference_k{b}v{b}", ls[0].nbytes(), ref))
        if cpu.available():
            out.append((f"cpu_k{b}v{b}", ls[0].nbytes(), lambda i, ls=ls: packed_attention(q, ls[i], kernel="cpu")))
    return out


def bench_decode(
    lengths: tuple[int, ...] = DEFAULT_LENGTHS, runs: int = 30, heads: int = 9, kv_heads: int = 3,
    head_dim: int = 64, bits: tuple[int, ...] = DEFAULT_BITS, group_size: int = GROUP_SIZE, seed: int = 0,
    threads: tuple[int, ...] | None = None, stream_bytes: int = STREAM_BYTES,
) -> list[dict]:
    """Median ms per call for each method, length and thread count (default: 1 and the current count).

    Rows: {method, tokens, threads, ms, bytes, gb_per_s, x_vs_sdpa, x_vs_1_thread, ratio_vs_sdpa,
    stream_gb_per_s, stream_bytes, of_stream}; stream_bytes: the streaming-read reference's size
    (:func:`stream_read_gbs`)."""
    before = torch.get_num_threads()
    threads = threads or tuple(sorted({1, before}))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 1, head_dim, generator=g)
    rows: list[dict] = []
    stream: dict[int, float] = {}
    try:
        for t in threads:
            torch.set_num_threads(t)
            stream[t] = stream_read_gbs(stream_bytes)
        for n in lengths:
            copies = max(2, math.ceil(ROTATE_BYTES / (2 * kv_heads * n * head_dim * 4)))
            ks = [torch.randn(1, kv_heads, n, head_dim, generator=g) for _ in range(copies)]
            vs = [torch.randn(1, kv_heads, n, head_dim, generator=g) for _ in range(copies)]
            layers = {b: [PackedKV.from_dense(ks[i], vs[i], LayerConfig(1.0, b, b), group_size)
                          for i in range(copies)] for b in bits}
            for t in threads:
                torch.set_num_threads(t)
                for method, nbytes, fn in _methods(q, ks, vs, layers, n):
                    rows.append({"method": method, "tokens": n, "threads": t, "ms": _time(fn, copies, runs),
                                 "bytes": nbytes})
            del ks, vs, layers
    finally:
        torch.set_num_threads(before)
    for r in rows:
        r["stream_gb_per_s"], r["stream_bytes"] = stream[r["threads"]], stream_bytes
    return _ratios(rows)


def _ratios(rows: list[dict]) -> list[dict]:
    sdpa = {(r["tokens"], r["threads"]): r["ms"] for r in rows if r["method"] == "sdpa_fp32"}
    one = {(r["method"], r["tokens"]): r["ms"] for r in rows if r["threads"] == 1}
    for r in rows:
        r["ratio_vs_sdpa"] = r["ms"] / sdpa[r["tokens"], r["threads"]]
        r["x_vs_sdpa"] = 1.0 / r["ratio_vs_sdpa"]
        r["gb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["of_stream"] = r["gb_per_s"] / r["stream_gb_per_s"]
        base = one.get((r["method"], r["tokens"]))
        r["x_vs_1_thread"] = base / r["ms"] if base else None
    return rows


def _goals(rows: list[dict]) -> list[str]:
    """The issue's targets for k4v4, read off the rows at the largest thread count."""
    top = max(r["threads"] for r in rows)
    k4 = {r["tokens"]: r for r in rows if r["method"] == "cpu_k4v4" and r["threads"] == top}
    if not k4:
        return []
    lines = ["", f"k4v4 at {top} threads against the targets (issue 15):", "",
             "| tokens | x faster than fp32 SDPA (target >= 5 at 8k) | GB/s (target >= 10 at 32k, 128k) "
             f"| % of the host's streaming read | {top} vs 1 thread (target >= 1.7 at 32k) |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for n, r in sorted(k4.items()):
        x1 = f"{r['x_vs_1_thread']:.2f}" if r["x_vs_1_thread"] else "-"
        lines.append(f"| {n} | {r['x_vs_sdpa']:.2f} | {r['gb_per_s']:.1f} | {100 * r['of_stream']:.0f}% | {x1} |")
    return lines


def _stream_line(rows: list[dict]) -> list[str]:
    """The host's streaming read rate per thread count, as measured in this run."""
    stream = dict(sorted({r["threads"]: r["stream_gb_per_s"] for r in rows}.items()))
    rates = ", ".join(f"{v:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, v in stream.items())
    size = f"{rows[0]['stream_bytes'] / 2**20:g} MB"
    return ["", f"This host's streaming read (torch.sum over {size} of fp32, same run): {rates}."]


def to_markdown(rows: list[dict]) -> str:
    counts = ", ".join(str(t) for t in sorted({r["threads"] for r in rows}))
    lines = [f"Decode attention, q 1x9x1x64, 3 KV heads, {counts} threads, median ms (x vs SDPA = fp32 SDPA time "
             "/ time at the same thread count, > 1 is faster; GB/s on the bytes each method reads; % stream = "
             "that GB/s over the host's streaming read at the same thread count)", "",
             "| method | tokens | threads | ms | x vs SDPA | bytes read | GB/s | % stream | x vs 1 thread |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        x1 = f"{r['x_vs_1_thread']:.2f}" if r["threads"] != 1 and r["x_vs_1_thread"] else "-"
        lines.append(f"| {r['method']} | {r['tokens']} | {r['threads']} | {r['ms']:.3f} | {r['x_vs_sdpa']:.2f} | "
                     f"{r['bytes']} | {r['gb_per_s']:.1f} | {100 * r['of_stream']:.0f}% | {x1} |")
    return "\n".join(lines + _stream_line(rows) + _goals(rows)) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", default="", help="comma list of thread counts (default: 1 and the current)")
    ap.add_argument("--out", default="bench_kernels", help="output prefix: writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    threads = tuple(int(x) for x in args.threads.split(",")) if args.threads else None
    rows = bench_decode(tuple(int(x) for x in args.lengths.split(",")), runs=args.runs, threads=threads)
    md = to_markdown(rows)
    atomic_write_text(Path(args.out + ".json"), json.dumps(rows, indent=1))
    atomic_write_text(Path(args.out + ".md"), md)
    print(md)


if __name__ == "__main__":
    main()
