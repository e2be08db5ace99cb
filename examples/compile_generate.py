"""Calibrate (or load a table) -> solve a plan -> prepare -> model.compile(backend="moend") -> generate.

    python examples/compile_generate.py                      # tiny random Llama, runs in about a minute
    python examples/compile_generate.py --model smollm2-135m --budget 14x --table smollm2.table

Prints the tokens of the eager MoENDCache path and of the compiled path, whether they agree, which layers were
fused into which kernel variant, and how many graphs dynamo compiled.

PITFALL: ``torch.compile(model).generate(...)`` compiles NOTHING. ``torch.compile(model)`` returns a wrapper
whose ``__call__`` is compiled, but ``generate`` is a plain method that calls the *original* module's forward,
so every step runs eagerly. Use ``model.compile(backend="moend", ...)`` (``nn.Module.compile``: compiles the
module's own ``__call__`` in place), then call ``model.generate(...)`` as usual.
"""

from __future__ import annotations

import argparse
import collections
import logging
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from moend_fx.cache.generation import prepare
from moend_fx.calibration.pipeline import calibrate
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.options import InnerCompiler, Kernel
from moend_fx.models import load_model, tiny_model
from moend_fx.solvers import get_solver


def load(name: str):
    if name == "tiny":
        return tiny_model("llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16), None
    return load_model(name)


def table_for(model, tokenizer, path: Path | None, tokens: int) -> SensitivityTable:
    """Load the sensitivity table from ``path`` if it exists; else calibrate (and save it there)."""
    if path is not None and path.is_file():
        return SensitivityTable.load(path)
    if tokenizer is None:  # a random-weight model: random calibration ids are as good as text
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        table = calibrate(model, token_ids=ids)
    else:
        table = calibrate(model, tokenizer, tokens=tokens)
    if path is not None:
        table.save(path)
    return table


class FusedLog(logging.Handler):
    """Counts the "layer N attention fused into <variant>" lines the fusion pass logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fused: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "fused into" in msg:
            self.fused[msg.split("fused into ")[1].split(" ")[0]] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (random weights) or an embedded model, e.g. smollm2-135m")
    ap.add_argument("--table", type=Path, default=None,
                    help="sensitivity table to load (or to write after calibrating)")
    ap.add_argument("--budget", default="4x", help="KV budget: bytes, '3MB' or a ratio of a 16-bit cache ('14x')")
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--inner", default=str(InnerCompiler.AOT_EAGER), choices=[str(c) for c in InnerCompiler])
    ap.add_argument("--kernel", default=str(Kernel.AUTO), choices=[str(k) for k in Kernel])
    args = ap.parse_args()

    model, tokenizer = load(args.model)
    table = table_for(model, tokenizer, args.table, args.calib_tokens)
    context = args.prompt_tokens + args.new_tokens
    plan = get_solver("greedy").solve(table, args.budget, context_length=context).plan
    print("plan:", ", ".join(f"L{i}={c.name}" for i, c in enumerate(plan.layers)))

    # prepare: generate() now builds a MoENDCache for this plan (its default attention function is
    # packed_layer_attention, the traceable form that the backend's fusion pass recognises), runs the prefill
    # eagerly and the cache's eviction between decode steps, outside the compiled graph.
    prepare(model, plan, table=table)

    if tokenizer is not None:
        text = "The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 10 + 1)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                            generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    t0 = time.perf_counter()
    eager = model.generate(ids, **gen)
    print(f"eager MoENDCache: {time.perf_counter() - t0:.1f} s")

    log = FusedLog()
    logging.getLogger("moend_fx.passes").addHandler(log)
    logging.getLogger("moend_fx.passes").setLevel(logging.INFO)
    counters.clear()
    # NOT torch.compile(model).generate(...): that compiles nothing (see the module docstring).
    # fullgraph=True: a decode step is one graph (eviction and group flushes run between steps, eagerly).
    options = {"plan": plan, "inner": args.inner, "kernel": args.kernel}
    model.compile(backend="moend", options=options, fullgraph=True)
    t0 = time.perf_counter()
    compiled = model.generate(ids, **gen)
    print(f"compiled (moend, inner={args.inner}): {time.perf_counter() - t0:.1f} s including compilation")

    new = slice(ids.shape[1], None)
    same = torch.equal(eager[:, new], compiled[:, new])
    print("same tokens as eager:", same, "" if same else f"({(eager[:, new] != compiled[:, new]).sum()} differ)")
    print("fused attention nodes (variant_layer: graphs):", dict(log.fused))
    breaks = sum(counters["graph_break"].values())
    print("graphs compiled:", counters["stats"]["unique_graphs"], "graph breaks:", breaks)
    if tokenizer is not None:
        print(tokenizer.decode(compiled[0, new]))


if __name__ == "__main__":
    main()
