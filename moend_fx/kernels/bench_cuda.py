"""Micro-benchmark of one decode attention call on a CUDA GPU: the Triton kernel over a compressed layer against
torch SDPA over 16-bit K/V of the same tokens (``moend bench triton``).

q: [B, 9, 1, 64] fp16 over 3 KV heads (SmolLM2's shapes) at several held lengths and batch sizes, in one run:
* ``sdpa_fp16``: ``F.scaled_dot_product_attention(enable_gqa=True)`` on dense fp16 K/V (what a 16-bit cache reads;
  the baseline),
* ``triton_k{b}v{b}``: the op's CUDA path (one launch: the decode kernel merges its own splits) as the op runs
  it: fp16 dot operands, fp32 accumulation, 128-token steps,
* ``dequant_sdpa_k{b}v{b}``: dequantize the layer to fp16 with torch ops, then the same SDPA (the unfused path,
  which writes and reads 16-bit K/V again),
* ``triton_k4v4_fp32``: the kernel with fp32 operands and IEEE dots (``precise=True``, the reference's values).

Every method gets copies of its inputs, used in rotation, whose bytes together exceed the L2 cache several times,
so each call reads K/V from HBM (as a decode step does: the cache is read once per step). Each call is timed with
CUDA events (median of ``runs``), launch included: at decode the launches are part of the cost. ``hbm_gb_per_s``
is the device's read rate in the same run (``torch.sum`` over ``STREAM_BYTES`` of fp16); ``of_hbm`` a row's share.
``max_err`` is the largest absolute difference from the fp32 reference over the same dequantized values (Triton)
or over the fp16 K/V (SDPA) on the first copy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moend_fx.attention.reference import attention_dense, reference_attention
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

DEFAULT_LENGTHS = (8192, 32768, 131072)
DEFAULT_BATCHES = (1, 16)
DEFAULT_BITS = (8, 4, 2)  # a 16/16 layer is plain SDPA (its tokens all sit in the residual window)
ROTATE_BYTES = 512 * 2**20  # ~8x an H100/H200's L2 (50-60 MB)
STREAM_BYTES = 2 * 2**30


def _check_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise MoendError("moend bench triton needs a CUDA GPU; torch sees none here (on a CPU run "
                         "`moend bench kernels`)")
    return torch.device("cuda")


def _time_ms(fn: Callable[[int], object], copies: int, runs: int) -> float:
    """Median ms of ``fn(i)`` over ``runs`` calls, each timed by CUDA events (launch included)."""
    for i in range(min(copies, 3)):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_read_gbs(nbytes: int = STREAM_BYTES, runs: int = 20) -> float:
    """GB/s that ``torch.sum`` reads from an fp16 tensor of ``nbytes`` on the GPU (median of ``runs``)."""
    x = torch.rand(nbytes // 2, device="cuda", dtype=torch.float16)
    ms = _time_ms(lambda i: x.sum(), 1, runs)
    return nbytes / (ms * 1e-3) / 1e9


def _methods(q: torch.Tensor, ks: list, vs: list, layers: dict[int, list[PackedKV]],
             bits: tuple[int, ...]) -> list[tuple[str, int, Callable[[int], torch.Tensor], Callable[[], torch.Tensor]]]:
    """(method, bytes read, fn(copy index), reference of copy 0) for one batch and length."""
    from moend_fx.kernels import layer_tensors
    from moend_fx.kernels.triton_decode import packed_attention_triton

    scale = 1.0 / math.sqrt(q.shape[-1])

    def triton(b: int, **kw) -> Callable[[int], torch.Tensor]:
        return lambda i: packed_attention_triton(q, *layer_tensors(layers[b][i]), b, b, GROUP_SIZE, scale, True, **kw)

    def dequant_sdpa(b: int) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            k, v = layers[b][i].dequantize(torch.float16)
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

        return run

    def ref(b: int) -> Callable[[], torch.Tensor]:
        return lambda: reference_attention(q.float(), layers[b][0], scale=scale)

    out = [("sdpa_fp16", 2 * ks[0].numel() * 2,
            lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], scale=scale, enable_gqa=True),
            lambda: attention_dense(q.float(), ks[0].float(), vs[0].float(), scale=scale))]
    out += [(f"triton_k{b}v{b}", layers[b][0].nbytes(), triton(b), ref(b)) for b in bits]
    out += [(f"dequant_sdpa_k{b}v{b}", layers[b][0].nbytes(), dequant_sdpa(b), ref(b)) for b in bits]
    if 4 in bits:
        out += [("triton_k4v4_fp32", layers[4][0].nbytes(), triton(4, precise=True), ref(4))]
    return out


def bench_triton(
    lengths: tuple[int, ...] = DEFAULT_LENGTHS, batches: tuple[int, ...] = DEFAULT_BATCHES, runs: int = 50,
    heads: int = 9, kv_heads: int = 3, head_dim: int = 64, bits: tuple[int, ...] = DEFAULT_BITS, seed: int = 0,
) -> list[dict]:
    """Rows {method, batch, tokens, ms, bytes, gb_per_s, x_vs_sdpa, hbm_gb_per_s, of_hbm, max_err, device}."""
    dev = _check_cuda()
    g = torch.Generator(device=dev).manual_seed(seed)
    hbm = hbm_read_gbs()
    rows: list[dict] = []
    for b in batches:
        q = torch.randn(b, heads, 1, head_dim, generator=g, device=dev, dtype=torch.float16)
        for n in lengths:
            copies = max(2, math.ceil(ROTATE_BYTES / (2 * b * kv_heads * n * head_dim * 2)))
            shape = (b, kv_heads, n, head_dim)
            ks = [torch.randn(shape, generator=g, device=dev, dtype=torch.float16) for _ in range(copies)]
            vs = [torch.randn(shape, generator=g, device=dev, dtype=torch.float16) for _ in range(copies)]
            layers = {w: [PackedKV.from_dense(ks[i], vs[i], LayerConfig(1.0, w, w), GROUP_SIZE)
                          for i in range(copies)] for w in bits}
            for method, nbytes, fn, ref in _methods(q, ks, vs, layers, bits):
                err = (fn(0).float() - ref()).abs().max().item()
                rows.append({"method": method, "batch": b, "tokens": n, "ms": _time_ms(fn, copies, runs),
                             "bytes": nbytes, "max_err": err})
            del ks, vs, layers
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(dev)
    sdpa = {(r["batch"], r["tokens"]): r["ms"] for r in rows if r["method"] == "sdpa_fp16"}
    for r in rows:
        r["gb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["x_vs_sdpa"] = sdpa[r["batch"], r["tokens"]] / r["ms"]
        r["hbm_gb_per_s"], r["of_hbm"], r["device"] = hbm, r["gb_per_s"] / hbm, name
    return rows


def to_markdown(rows: list[dict]) -> str:
    device, hbm = rows[0]["device"], rows[0]["hbm_gb_per_s"]
    lines = [f"Decode attention on {device}, q Bx9x1x64 fp16, 3 KV heads, median ms per call (CUDA events, launch "
             "included); x vs SDPA = fp16 SDPA time / time (> 1 is faster); GB/s on the bytes each method reads; "
             "% HBM = that over the device's read rate in this run; max err = largest |difference| from the fp32 "
             "reference over the same values", "",
             "| method | batch | tokens | ms | x vs SDPA | bytes read | GB/s | % HBM | max err |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch']} | {r['tokens']} | {r['ms']:.4f} | {r['x_vs_sdpa']:.2f} | "
                     f"{r['bytes']} | {r['gb_per_s']:.0f} | {100 * r['of_hbm']:.0f}% | {r['max_err']:.1e} |")
    lines += ["", f"The device's read rate (torch.sum over {STREAM_BYTES / 2**30:g} GiB of fp16, same run): "
              f"{hbm:.0f} GB/s."]
    return "\n".join(lines) + "\n"
