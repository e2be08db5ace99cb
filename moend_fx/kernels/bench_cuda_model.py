"""The GPU's end-to-end figures for ``.ci/gpu`` (``python -m moend_fx.kernels.bench_cuda_model --out DIR``).

* ``plan_step``: one decode step's attention over every layer of SmolLM2-135M's shape (30 layers, 9 query heads
  over 3 KV heads, head_dim 64, fp16) at the lengths given: the greedy plan at ``budget`` (on the model's cached
  sensitivity table, else the synthetic 30-layer one) through the op (each layer's kept tokens, bits and group
  size), against fp16 SDPA over the full cache of every layer. Each layer's K/V are random: attention time does
  not depend on the values.
* ``model_decode``: tokens per second of ``model.generate`` (greedy) on the embedded SmolLM2-135M in fp16 after a
  random prompt of ``context`` tokens, at each batch size: the full cache (``DynamicCache``) against ``prepare``
  with the same plan (the Triton kernel through the op). Decode time is the run of ``steps`` new tokens less a
  run of one (the prefill and the first token).

Needs CUDA: without it every entry point raises :class:`MoendError` naming the problem (``main`` exits 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
MODEL = "smollm2-135m"


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise MoendError("the GPU benchmarks need a CUDA GPU; torch sees none here (on a CPU run `moend bench "
                         "kernels`, or `moend bench kernels --static` for the Triton kernel's SASS figures)")
    return torch.device("cuda")


def plan_for(budget: str, length: int, layers: int = LAYERS, model: str = MODEL):
    """The greedy plan at ``budget`` for ``length`` tokens: on the model's cached table if present, else synthetic."""
    from moend_fx.calibration.tables import default_table_path, load_table
    from moend_fx.solvers import get_solver

    cached = default_table_path(model)
    table = load_table(str(cached) if cached.is_file() else f"synthetic:{layers}")
    return get_solver("greedy").solve(table, budget, context_length=length).plan


def _timed_ms(fn, runs: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs


def _step_rows(n: int, budget: str, batch: int, runs: int, g: torch.Generator) -> list[dict]:
    from moend_fx.kernels.ops import packed_attention
    from moend_fx.storage.packed import PackedKV

    dev = g.device
    plan = plan_for(budget, n)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=g, device=dev, dtype=torch.float16)
    full = [(torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g, device=dev, dtype=torch.float16),
             torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g, device=dev, dtype=torch.float16))
            for _ in range(LAYERS)]
    packed = []
    for (k, v), cfg in zip(full, plan.layers, strict=True):
        kept = max(1, math.ceil(cfg.keep_ratio * n))
        pos = torch.arange(kept, device=dev).expand(batch, KV_HEADS, kept) if cfg.evicts else None
        packed.append(PackedKV.from_dense(k[:, :, :kept], v[:, :, :kept], cfg, plan.group_size, positions=pos))

    def sdpa():
        for k, v in full:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def moend():
        for layer in packed:
            packed_attention(q, layer, causal=False)

    base, ms = _timed_ms(sdpa, runs), _timed_ms(moend, runs)
    return [{"method": "sdpa_fp16_full", "tokens": n, "batch": batch, "ms": base, "x_vs_sdpa": 1.0,
             "bytes": sum(2 * k.numel() * 2 for k, _ in full)},
            {"method": f"moend_{budget}", "tokens": n, "batch": batch, "ms": ms, "x_vs_sdpa": base / ms,
             "bytes": sum(layer.nbytes() for layer in packed)}]


def plan_step(lengths=(32768, 131072), budget: str = "14x", batch: int = 1, runs: int = 20) -> list[dict]:
    """Rows {method, tokens, batch, ms, bytes, x_vs_sdpa} for one decode step's attention over all layers."""
    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in lengths:
        rows += _step_rows(n, budget, batch, runs, g)
        torch.cuda.empty_cache()
    return rows


def _generate_s(model, ids: torch.Tensor, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def model_decode(context: int = 8192, batches=(1, 16), steps: int = 33, budget: str = "14x") -> list[dict]:
    """Rows {method, batch, context, tokens_per_s} of greedy decoding: the full cache, then the plan's MoENDCache."""
    from moend_fx.cache.generation import prepare, unprepare
    from moend_fx.models import load_model

    dev = _cuda()
    model = load_model(MODEL).to(dev, torch.float16).eval()
    plan = plan_for(budget, context, model.config.num_hidden_layers)
    rows = []
    for batch in batches:
        ids = torch.randint(100, 20000, (batch, context), generator=torch.Generator().manual_seed(batch)).to(dev)
        for method in ("full", f"moend_{budget}"):
            if method != "full":
                prepare(model, plan)
            try:
                first = _generate_s(model, ids, 1)
                total = _generate_s(model, ids, steps)
            finally:
                if method != "full":
                    unprepare(model)
            rows.append({"method": method, "batch": batch, "context": context,
                         "tokens_per_s": batch * (steps - 1) / max(total - first, 1e-9)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu", help="folder for plan_step.json and model_decode.json")
    ap.add_argument("--lengths", default="32768,131072", help="plan step lengths (comma list)")
    ap.add_argument("--context", type=int, default=8192, help="model decode prompt tokens")
    ap.add_argument("--parts", default="plan_step,model_decode", help="comma list of plan_step, model_decode")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        _cuda()
        if "plan_step" in args.parts:
            rows = plan_step(tuple(int(x) for x in args.lengths.split(",")))
            atomic_write_text(out / "plan_step.json", json.dumps(rows, indent=1) + "\n")
            print(json.dumps(rows, indent=1))
        if "model_decode" in args.parts:
            rows = model_decode(args.context)
            atomic_write_text(out / "model_decode.json", json.dumps(rows, indent=1) + "\n")
            print(json.dumps(rows, indent=1))
    except MoendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
