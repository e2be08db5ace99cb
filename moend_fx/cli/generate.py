"""``moend generate``: a prompt through a model prepared with a routing plan (optionally compiled with the
``moend`` backend); prints the answer, the measured cache memory against the full cache, and the time.

    moend generate --model smollm2-135m --budget 14x --prompt "The capital of France is"
    moend generate --plan plan.json --compile --file prompt.txt --max-new-tokens 32

Where the plan comes from: ``--plan FILE``; or ``--budget`` solved with greedy on a sensitivity table for the
prompt's length plus ``--max-new-tokens``. The table is ``--table``, else the cached table of ``--setting``
(query_aware by default: ``$MOEND_CACHE/tables/<model>-snapkv_trig-2048.safetensors``, what ``moend calibrate
--setting query_aware`` writes; query_agnostic: ``<model>-trig-2048``), else a quick calibration
(``--calib-tokens``, default 1024) saved to ``$MOEND_CACHE/tables/<model>-<scorer>-<N>.safetensors`` and reused.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from moend_fx.calibration.tables import SETTING_TABLES_HINT
from moend_fx.cli.args import names
from moend_fx.common.checks import check_int
from moend_fx.common.defaults import CALIBRATION_TOKENS, DEFAULT_MODEL, PREFILL_CHUNK, PREFILL_CHUNK_ABOVE
from moend_fx.common.errors import MoendError, PlanError
from moend_fx.common.options import Setting


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise MoendError(f"prompt file {args.file!r} does not exist")
        text = path.read_text()
    else:
        text = args.prompt
    if not text.strip():
        raise MoendError("the prompt is empty; give --prompt TEXT or --file PATH with some text")
    return text


def find_table(args: argparse.Namespace, model: Any, tokenizer: Any) -> tuple[Any, str]:
    """(table, where it came from): --table, the setting's cached 2048-token table, a cached quick one, or
    calibrate (with the scorer of ``--setting``)."""
    from moend_fx.calibration.pipeline import calibrate, stale_reason
    from moend_fx.calibration.sensitivity import SensitivityTable
    from moend_fx.calibration.tables import default_table_path, load_table
    from moend_fx.eviction.scorers import default_scorer

    if args.table is not None:
        return load_table(args.table), args.table
    scorer = default_scorer(args.setting)
    for tokens in (CALIBRATION_TOKENS, args.calib_tokens):
        path = default_table_path(args.model, tokens, scorer=scorer)
        if path.is_file():
            table = SensitivityTable.load(path)
            why = stale_reason(table)
            if why is None:
                return table, str(path)
            print(f"skipping {path}: {why}", file=sys.stderr)

    path = default_table_path(args.model, args.calib_tokens, scorer=scorer)
    print(f"no {args.setting} sensitivity table for {args.model}: calibrating on {args.calib_tokens} tokens "
          f"(saved to {path}; run `moend calibrate --setting {args.setting}` for the full {CALIBRATION_TOKENS}-token "
          "table)", file=sys.stderr)
    table = calibrate(model, tokenizer, tokens=args.calib_tokens, scorer=scorer, progress=not args.quiet)
    table.save(path)
    return table, f"{path} (just calibrated)"


def get_plan(args: argparse.Namespace, model: Any, tokenizer: Any, context_length: int) -> tuple[Any, Any, str]:
    """(plan, table or None, a sentence saying where the plan came from)."""
    from moend_fx.plan.routing import ModelFingerprint, RoutingPlan
    from moend_fx.solvers import get_solver

    if args.plan is not None:
        if not Path(args.plan).is_file():
            raise PlanError(f"plan file {args.plan!r} does not exist")
        plan = RoutingPlan.load(args.plan)
        plan.check_model(model)
        return plan, None, f"{args.plan} ({plan.solver}, solved for {plan.context_length} tokens)"
    table, source = find_table(args, model, tokenizer)
    why = table.fingerprint.mismatch(ModelFingerprint.from_model(model), "table")
    if why:
        raise PlanError(f"table {source} was made for another model: {why}; calibrate one for this model")
    res = get_solver("greedy").solve(table, args.budget, context_length=context_length)
    return res.plan, table, f"greedy for budget {args.budget} on {source}, solved for {context_length} tokens"


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from moend_fx.cache.generation import check_prefill_chunk, prepare
    from moend_fx.models import load_model
    from moend_fx.plan.memory import format_bytes, full_cache_bytes
    from moend_fx.plan.summary import plan_summary

    check_int("--max-new-tokens", args.max_new_tokens)
    prompt = read_prompt(args)
    # Files first: a typo should not cost a model load.
    if args.plan is not None and not Path(args.plan).is_file():
        raise PlanError(f"plan file {args.plan!r} does not exist")
    if args.table is not None and not args.table.startswith("synthetic:") and not Path(args.table).is_file():
        raise MoendError(f"table file {args.table!r} does not exist; give a .safetensors table from "
                         "`moend calibrate`, or leave --table out to use the cached one")
    chunk, above = check_prefill_chunk(args.prefill_chunk, args.prefill_chunk_above)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    if args.chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    n_prompt = int(ids.shape[1])
    plan, table, source = get_plan(args, model, tok, n_prompt + args.max_new_tokens)
    prepare(model, plan, table=table, prefill_chunk=chunk, prefill_chunk_above=above)
    if args.compile:
        import moend_fx.compile.backend  # noqa: F401  (registers the backend; the entry point finds it too)

        model.compile(backend="moend", options={"plan": plan})
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=pad)
    wall = time.perf_counter() - t0
    new = out.sequences[0, n_prompt:]
    print(tok.decode(new, skip_special_tokens=True).strip())
    print("---")
    cache = out.cache
    tokens = int(cache.get_seq_length())
    measured = int(cache.nbytes().total)
    full16 = full_cache_bytes(model, tokens)
    fullm = full_cache_bytes(model, tokens, dtype=None)
    dtype = str(model.dtype).replace("torch.", "")
    print(f"plan: {source}: {plan_summary(plan)}")
    print(f"cache: {format_bytes(measured)} measured for {tokens} tokens; full cache {format_bytes(full16)} at 16 bits "
          f"({full16 / measured:.1f}x smaller), {format_bytes(fullm)} in {dtype} ({fullm / measured:.1f}x)")
    mode = "compiled with backend=moend, compilation included" if args.compile else "eager"
    prefill = f"prefill in chunks of {chunk}" if chunk and n_prompt > above else "prefill in one pass"
    print(f"time: {len(new)} new tokens after a {n_prompt}-token prompt in {wall:.2f} s "
          f"({len(new) / wall:.1f} tokens/s; {mode}; {prefill})")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="generate from a prompt with a compressed (and optionally compiled) cache",
        description="Load the model, get a plan (--plan, or --budget solved on a table), prepare the model, "
                    "optionally model.compile(backend='moend'), generate greedily; print the answer, the "
                    "cache memory vs the full cache, and the time.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder (default %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--plan", default=None, help="routing plan JSON (from `moend solve --out`)")
    src.add_argument("--budget", default="14x",
                     help="budget solved with greedy: a ratio of the 16-bit cache ('14x') or a size ('3MB'); "
                          "default %(default)s")
    p.add_argument("--setting", default=str(Setting.QUERY_AWARE), choices=names(Setting),
                   help="query_aware (the prompt ends with its question: compressed by what its last queries "
                        "attend to) or query_agnostic (compressed before any question); picks the default table "
                        "and its scorer (default %(default)s)")
    p.add_argument("--table", default=None,
                   help=f"sensitivity table for --budget (default: the setting's, {SETTING_TABLES_HINT}; else a "
                        "quick calibration)")
    p.add_argument("--calib-tokens", type=int, default=1024,
                   help="tokens of the quick calibration when no table exists (default %(default)s)")
    p.add_argument("--compile", action="store_true", help="model.compile(backend='moend') before generating")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", default=None, help="the prompt text")
    text.add_argument("--file", default=None, help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="prefill a long prompt in chunks of this many tokens, each compressed before the next "
                        "(default %(default)s; 0 = one pass; docs/cache.md)")
    p.add_argument("--prefill-chunk-above", type=int, default=PREFILL_CHUNK_ABOVE,
                   help="chunk only prompts longer than this (default %(default)s tokens)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)
