"""Quickstart: compress SmolLM2-135M's KV cache 8x with MoE-nD and generate, eagerly (no compile).

    python examples/quickstart.py [--budget 8x] [--tokens 1024]

Steps: load the embedded model -> calibrate a sensitivity table on `--tokens` tokens (about a minute on 2 CPU
cores) -> greedy plan under the budget -> prepare the model -> generate.
"""

from __future__ import annotations

import argparse

import torch

import moend_fx
from moend_fx.calibration.pipeline import calibrate
from moend_fx.common.defaults import DEFAULT_MODEL
from moend_fx.models import load_model
from moend_fx.plan.memory import format_bytes, full_cache_bytes
from moend_fx.solvers import get_solver


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="8x")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()

    model, tok = load_model(DEFAULT_MODEL)
    table = calibrate(model, tok, tokens=args.tokens, progress=True)
    text = open(__file__).read() * 4  # any long text: here, this file
    ids = tok(text + "\nIn one sentence, this script", return_tensors="pt")
    n = ids["input_ids"].shape[1]
    plan = get_solver("greedy").solve(table, args.budget, context_length=n + 20).plan
    moend_fx.prepare(model, plan, table=table)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    print(tok.decode(out.sequences[0, n:], skip_special_tokens=True))
    used = out.cache.nbytes().total
    print(f"cache: {format_bytes(used)} vs {format_bytes(full_cache_bytes(model, n + 20))} for a 16-bit cache")


if __name__ == "__main__":
    main()
