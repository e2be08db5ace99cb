"""``moend bench {decode,prefill,eval,solvers,proxy,search,heads,calibrate,kernels,triton,all}``: benchmarks that
write JSON + Markdown (+ PNG) under ``--out`` (default ``results/bench``) and update their section of
``docs/results.md``.

Each section of ``docs/results.md`` starts with the command that regenerates it, rebuilt from the parsed
options (only those that differ from the defaults, plus ``--out``). ``moend bench all`` runs each benchmark
through the same parser with modest defaults (``--quick``: smaller still), so its sections carry the same
kind of command. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

from typing import Any

from moend_fx.bench.published import PUBLISHED_EVAL
from moend_fx.bench.report import KEYS
from moend_fx.calibration.tables import DEFAULT_TABLE_HINT, SETTING_TABLES_HINT
from moend_fx.cli.args import names, positive_int
from moend_fx.cli.bench_all import cmd_all
from moend_fx.cli.bench_commands import (
    cmd_calibrate,
    cmd_decode,
    cmd_eval,
    cmd_heads,
    cmd_kernels,
    cmd_prefill,
    cmd_proxy,
    cmd_search,
    cmd_solvers,
    cmd_triton,
    command_line,
)
from moend_fx.cli.bench_speculative import add_parser as add_speculative
from moend_fx.cli.calibrate import add_tail_option
from moend_fx.cli.search import add_measured_args
from moend_fx.common.defaults import CALIBRATION_TOKENS, DEFAULT_MODEL
from moend_fx.common.options import InnerCompiler, Kernel, ReEviction
from moend_fx.eval.parts import describe_parts

DEFAULT_OUT = "results/bench"
DEFAULT_DOC = "docs/results.md"

__all__ = ["DEFAULT_DOC", "DEFAULT_OUT", "PUBLISHED_EVAL", "command_line", "register"]


def _common(p: Any, func: Any, *, threads: bool = True) -> None:
    """The options every benchmark takes, and its handler. ``declared_options`` (the actions this parser
    added) lets :func:`~moend_fx.cli.bench_commands.command_line` rebuild the regenerating command."""
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (default %(default)s)")
    p.add_argument("--doc", default=DEFAULT_DOC,
                   help="results document to update (default %(default)s; '' to leave it alone)")
    if threads:
        p.add_argument("--threads", type=int, default=0, help="torch threads (default 0 = all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=func, declared_options=p.declared, in_all=False)


def _plan_args(p: Any, budget: str, uniform: Any) -> None:
    """--table / --plan / --budget / --uniform: where a benchmark's MoENDCache plan comes from (uniform: a
    LayerConfig, the default of --uniform)."""
    p.add_argument("--table", default=None, help="sensitivity table: the MoENDCache plan is solved on it (greedy at "
                   f"--budget; default: the cached {DEFAULT_TABLE_HINT}, else --uniform)")
    p.add_argument("--plan", default=None, help="plan JSON for the MoENDCache rows (instead of --table)")
    p.add_argument("--budget", default=budget, help="budget for --table (default %(default)s of the 16-bit cache)")
    p.add_argument("--uniform", default=f"{uniform.keep_ratio:g},{uniform.k_bits},{uniform.v_bits}",
                   help="without --table/--plan: KEEP,KBITS,VBITS on every layer (default %(default)s)")


def register(subparsers: Any) -> None:
    # The defaults are the library's own (one home): the settings classes' field defaults.
    from moend_fx.bench.decode import METHODS, DecodeBenchSettings
    from moend_fx.bench.prefill import MALLOCS, MODES, PrefillBenchSettings
    from moend_fx.eval.proxy import ProxySettings
    from moend_fx.eval.tasks.registry import SETTINGS

    dec, proxy, pre = DecodeBenchSettings(), ProxySettings(), PrefillBenchSettings()
    uniform = dec.uniform

    b = subparsers.add_parser("bench",
                              help="benchmarks: decode, prefill, eval, solvers, proxy, search, heads, calibrate, "
                                   "kernels, triton, all",
                              description="Each benchmark writes JSON + Markdown (+ PNG) under --out and "
                                          "updates its section of docs/results.md.")
    sub = b.add_subparsers(dest="bench", metavar="BENCHMARK")
    b.set_defaults(func=lambda a: (b.print_help(), 2)[1])

    d = sub.add_parser("decode", help="per-token decode time and memory: full vs MoENDCache, eager vs compiled",
                       description="One run, every method at every context length; ratios against full_eager.")
    d.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder")
    d.add_argument("--lengths", default=",".join(map(str, dec.lengths)), help="context lengths (default %(default)s)")
    d.add_argument("--steps", type=positive_int, default=dec.steps,
                   help="measured decode steps (median; default %(default)s)")
    d.add_argument("--warmup", type=int, default=dec.warmup,
                   help="warm-up decode steps (pay compilation; default %(default)s)")
    d.add_argument("--methods", default="all", help=f"'all' or a comma list of {', '.join(METHODS)}")
    _plan_args(d, dec.budget, uniform)
    d.add_argument("--bandwidth", type=float, default=dec.bandwidth_gbs,
                   help="memory bandwidth in GB/s for the roofline (default %(default)s)")
    d.add_argument("--kernel", default=str(dec.kernel), choices=names(Kernel), help="moend backend kernel")
    d.add_argument("--inner", default=str(dec.inner), choices=names(InnerCompiler),
                   help="moend backend inner compiler")
    d.add_argument("--seed", type=int, default=dec.seed, help="seed of the random context tokens")
    d.add_argument("--batches", default=",".join(map(str, dec.batches)),
                   help="batch sizes decoded together (rows of random tokens; tokens/s = batch / step time; "
                        "default %(default)s)")
    d.add_argument("--batch-lengths", default="",
                   help="context lengths at which every --batches size runs; the others run batch 1 only "
                        "(default: every length)")
    d.add_argument("--memory-cap", default="",
                   help="e.g. 8GB: also the largest batch of each method under this cap, predicted from the memory "
                        "model (default: none)")
    d.add_argument("--evict-every", type=positive_int, default=dec.evict_every,
                   help="MoENDCache rows: room a layer leaves when it evicts, min(N, 32) tokens (1: hold the cap "
                        "and re-evict at every step once it is reached; default %(default)s)")
    d.add_argument("--reevict", default=str(dec.reevict), choices=names(ReEviction),
                   help="MoENDCache rows: what a decode-time re-eviction drops (default %(default)s)")
    d.add_argument("--prefill-chunk", type=int, default=dec.prefill_chunk,
                   help="tokens per prefill forward, each chunk fed through the cache before the next (0: one "
                        "forward; default %(default)s); a long sliding-window hybrid's one-pass prefill is slow")
    d.add_argument("--compile-times", action="store_true",
                   help="also the cold and warm compile time of each compiled method's decode graph, each in a "
                        "fresh process with a new TORCHINDUCTOR_CACHE_DIR, at the shortest --lengths")
    _common(d, cmd_decode)

    f = sub.add_parser("prefill", help="a long prompt's prefill: chunked vs one-shot time, peak RSS, accuracy",
                       description="Each mode in a fresh process, on a passkey prompt of --length tokens.")
    f.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder")
    f.add_argument("--length", type=positive_int, default=pre.length, help="prompt tokens (default %(default)s)")
    f.add_argument("--chunk", type=positive_int, default=pre.chunk, help="tokens per chunk (default %(default)s)")
    f.add_argument("--modes", default=",".join(pre.modes), help=f"comma list of {', '.join(MODES)}")
    f.add_argument("--examples", type=positive_int, default=pre.examples, help="passkey prompts (default 1)")
    f.add_argument("--new-tokens", type=positive_int, default=pre.new_tokens, help="answer tokens (default 8)")
    _plan_args(f, pre.budget, pre.uniform)
    f.add_argument("--malloc", default=pre.malloc, choices=MALLOCS,
                   help="fixed: glibc mmap threshold fixed so RSS follows live memory (default); default: untuned")
    f.add_argument("--seed", type=int, default=pre.seed, help="seed of the passkey prompts")
    _common(f, cmd_prefill)

    s = sub.add_parser("solvers", help="solver speed and gaps to the exact optimum",
                       description="compare-solvers + timing on one table.")
    s.add_argument("--model", default=DEFAULT_MODEL, help="model whose cached table is the default")
    s.add_argument("--table", default=None,
                   help="table file or synthetic:LAYERS[:SEED] (default: the cached SmolLM2 table, else "
                        "synthetic:30)")
    s.add_argument("--budgets", default="4x,8x,14x", help="comma-separated budgets (default %(default)s)")
    s.add_argument("--trials", default="", help="optuna trial counts, e.g. 200,2000 (default: none)")
    s.add_argument("--repeats", type=positive_int, default=20, help="greedy timing repeats (default %(default)s)")
    s.add_argument("--context-length", type=positive_int, default=None, help="tokens (default: the table's)")
    _common(s, cmd_solvers, threads=False)

    c = sub.add_parser("calibrate", help="time the calibration (54 configs per layer)")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--tokens", type=positive_int, default=CALIBRATION_TOKENS,
                   help="calibration tokens (default %(default)s)")
    c.add_argument("--sequences", type=positive_int, default=1)
    _common(c, cmd_calibrate)

    k = sub.add_parser("kernels", help="decode attention micro-benchmark (fused CPU kernel vs SDPA)")
    k.add_argument("--lengths", default="2048,8192,32768", help="held tokens (default %(default)s)")
    k.add_argument("--runs", type=positive_int, default=30, help="timed calls per method (median)")
    k.add_argument("--static", action="store_true",
                   help="no timing: compile the Triton decode kernel's variants for sm_90/sm_80 here and report "
                        "registers, spills, main-loop instructions per byte, I2F and dots (no GPU needed)")
    _common(k, cmd_kernels)

    t = sub.add_parser("triton", help="decode attention on a CUDA GPU: Triton kernel vs fp16 SDPA")
    t.add_argument("--lengths", default="8192,32768,131072", help="held tokens (default %(default)s)")
    t.add_argument("--batches", default="1,16", help="batch sizes (default %(default)s)")
    t.add_argument("--runs", type=positive_int, default=50, help="timed calls per method (median)")
    _common(t, cmd_triton)

    e = sub.add_parser("eval", help="accuracy vs memory: the published configuration by default (about 80 min on "
                                    "2 cores; resumes from --out)")
    e.add_argument("--model", default=DEFAULT_MODEL)
    e.add_argument("--table", default=None, help=f"table for every setting (default {SETTING_TABLES_HINT})")
    parts = describe_parts(PUBLISHED_EVAL["parts"])
    e.add_argument("--tasks", default=None, help=f"comma-separated tasks (default: each part's; the parts: {parts})")
    e.add_argument("--lengths", default=None,
                   help="prompt lengths: one part of these lengths, with --tasks and --n or the first part's (default: "
                        "the parts above)")
    e.add_argument("--n", type=positive_int, default=None,
                   help="examples per task and length (default: each part's)")
    e.add_argument("--budgets", default=",".join(PUBLISHED_EVAL["budgets"]), help="default %(default)s")
    e.add_argument("--methods", default=",".join(PUBLISHED_EVAL["methods"]), help="default %(default)s")
    e.add_argument("--settings", default=",".join(SETTINGS))
    e.add_argument("--max-new-tokens", type=positive_int, default=24)
    _common(e, cmd_eval)

    x = sub.add_parser("proxy", help="validate the calibration proxy against end-to-end KL on held-out text")
    x.add_argument("--model", default=DEFAULT_MODEL)
    x.add_argument("--table", default=None, help=f"table (default {DEFAULT_TABLE_HINT})")
    x.add_argument("--sequences", type=positive_int, default=proxy.sequences,
                   help="held-out sequences (default %(default)s)")
    x.add_argument("--tokens", type=positive_int, default=proxy.tokens,
                   help="context tokens each (default %(default)s)")
    x.add_argument("--plans", type=positive_int, default=proxy.random_plans, help="random plans (default %(default)s)")
    add_tail_option(x, proxy)
    _common(x, cmd_proxy)

    from moend_fx.search import SearchSettings

    r = sub.add_parser("search", help="greedy and exact vs an Optuna search on measured KL, at 8x and 14x",
                       description="The measured plan search of `moend search`, published as a section.")
    r.add_argument("--budgets", default="8x,14x", help="comma-separated budgets (default %(default)s)")
    r.add_argument("--table", default=None, help=f"sensitivity table (default: the cached {DEFAULT_TABLE_HINT})")
    r.add_argument("--storage", default=None, help="optuna storage (default: OUT/search/study.db)")
    add_measured_args(r, trials_flag="--trials", trials_default=SearchSettings().trials, runtime=False)
    _common(r, cmd_search)

    from moend_fx.bench.head_budgets import HeadBudgetSettings

    hb = HeadBudgetSettings()
    h = sub.add_parser("heads", help="per-KV-head budgets (Ada-KV) inside MoE-nD's plans, simulated, vs the real cache",
                       description="The real MoENDCache, a simulation with one count per head and one with counts "
                                   "per head, same plans and examples; resumes from --out.")
    h.add_argument("--model", default=DEFAULT_MODEL)
    h.add_argument("--table", default=None, help=f"table for every setting (default {SETTING_TABLES_HINT})")
    h.add_argument("--task", default=hb.task, help="evaluation task (default %(default)s)")
    h.add_argument("--length", type=positive_int, default=hb.length, help="prompt tokens (default %(default)s)")
    h.add_argument("--n", type=positive_int, default=hb.n, help="examples (default %(default)s)")
    h.add_argument("--budgets", default=",".join(hb.budgets), help="default %(default)s")
    h.add_argument("--settings", default=",".join(SETTINGS), help="default %(default)s")
    h.add_argument("--method", default=hb.method, help="whose plan (default %(default)s)")
    h.add_argument("--alpha", type=float, default=hb.alpha,
                   help="share of the layer's count every head keeps at least (default %(default)s)")
    _common(h, cmd_heads)

    add_speculative(sub, _common)

    a = sub.add_parser("all", help="run every benchmark and rewrite docs/results.md",
                       description="Runs " + ", ".join(KEYS) + " with modest defaults (--quick: smaller).")
    a.add_argument("--quick", action="store_true", help="small settings (minutes, not an hour)")
    a.add_argument("--only", default=None, help=f"comma list of {', '.join(KEYS)}")
    a.add_argument("--skip", default=None, help="comma list of benchmarks to skip")
    _common(a, cmd_all)
