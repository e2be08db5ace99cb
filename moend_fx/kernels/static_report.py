"""What the Triton decode kernel will do on a GPU, read on a machine without one (``moend bench kernels --static``).

Each shipped specialisation (:data:`SHIPPED`) is compiled for sm_90 (and sm_80) with the constexprs, warps and
divisibility hints its real launch uses (:func:`static_spec`), by the ``ptxas``
that Triton's wheel bundles; the bundled ``cuobjdump`` and ``nvdisasm`` then give, per variant:

* ``registers``, ``local_bytes`` (spills: any local memory is a spill here), ``shared_bytes``;
* the **main loop**: the first loop of the SASS (a backward branch) that holds a tensor-core dot: the packed-token
  loop, which the launcher runs over all but the last < G tokens. ``loop_instructions`` counts its SASS
  instructions (NOPs excluded), each issued once per warp per iteration, so ``instr_per_byte`` =
  ``loop_instructions * num_warps / loop_bytes``, where ``loop_bytes`` is what one iteration reads from HBM
  (codes, scales and zeros of ``BLOCK_N`` tokens). An H200 affords ~0.2 (4.8 TB/s over 132 SMs at ~2 GHz is
  ~18 bytes a clock per SM against 4 warp-instructions a clock);
* ``loop_i2f``: integer-to-float conversions in the main loop (``I2F*``), ``loop_dot``: its tensor-core dot
  instruction(s) (``HMMA.16816.F32`` takes fp16 operands, ``HMMA.1688.F32.TF32`` fp32 ones), ``loop_loads``: its
  global loads by width.

The SASS of every variant is written beside the JSON, so anyone can recount.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text

# (k_bits, v_bits, head_dim, gqa): the bit pairs of the plans at SmolLM2's shape (head_dim 64, 3 query heads a KV
# head), k4v4 at Qwen2.5-0.5B's (GQA 7) and at head_dim 128 / 256.
SHIPPED: tuple[tuple[int, int, int, int], ...] = (
    (2, 2, 64, 3), (4, 4, 64, 3), (8, 8, 64, 3), (2, 4, 64, 3), (4, 2, 64, 3), (4, 8, 64, 3), (8, 4, 64, 3),
    (16, 4, 64, 3), (4, 16, 64, 3), (4, 4, 64, 7), (4, 4, 128, 3), (4, 4, 256, 1),
)
ARCHS = (90, 80)
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")


@dataclass(frozen=True)
class StaticFigures:
    variant: str
    arch: int
    registers: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    block_n: int
    loop_instructions: int
    loop_bytes: int
    instr_per_byte: float
    loop_i2f: int
    loop_dot: dict[str, int]
    loop_loads: dict[str, int]


@dataclass(frozen=True)
class StaticSpec:
    """What the launch of one variant compiles: the kernel, its signature, constexprs, the arguments the launch
    passes 16-divisible (pointers, the split length, P: a multiple of the K group), warps, stages, the register cap,
    and the HBM bytes of one main-loop step."""

    fn: object
    signature: dict
    constexprs: dict
    divisible: tuple
    num_warps: int
    num_stages: int
    maxnreg: int
    loop_bytes: int


def _side_bytes(bits: int, tokens: int, head_dim: int, group_size: int, per_channel: bool) -> int:
    """Bytes of one side for ``tokens`` packed tokens: codes plus fp16 scale and zero (docs/cache-format.md)."""
    if bits == 16:
        return tokens * head_dim * 2
    groups = (tokens // group_size) * head_dim if per_channel else tokens * (head_dim // min(group_size, head_dim))
    return tokens * head_dim * bits // 8 + groups * 2 * 2


def static_spec(k_bits: int, v_bits: int, head_dim: int, gqa: int, group_size: int = GROUP_SIZE) -> StaticSpec:
    """The decode launch of one layer at batch B, one query (L = 1), no mask, several splits (the long-context
    case); 16-bit sides in fp16. Its constexprs are the launch's (:func:`triton_decode.constexprs`)."""
    import triton

    from moend_fx.kernels import triton_decode as td

    if td.INTERPRETED:
        raise MoendError("the static report compiles for a GPU: run it without TRITON_INTERPRET=1")
    block_n = td.block_n_for(group_size)
    const = td.constexprs(k_bits, v_bits, head_dim, group_size, gqa, max(16, triton.next_power_of_2(gqa)), block_n,
                          v_res=v_bits == 16, split=True)
    const["L"] = 1  # one query a row: Triton specialises an int argument equal to 1 as a constant, as here
    ptrs = {"q_ptr": "*fp16", "kp": "*i32" if k_bits < 16 else "*fp16", "ks": "*fp16", "kz": "*fp16",
            "vp": "*i32" if v_bits < 16 else "*fp16", "vs": "*fp16", "vz": "*fp16", "kr": "*fp16", "vr": "*fp16",
            "mask_ptr": "*i32", "out": "*fp16", "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32",
            "tickets": "*i32"}
    fn = td._decode_kernel
    sig = {n: ptrs.get(n, "fp32" if n == "scale" else "constexpr" if n in const else "i32") for n in fn.arg_names}
    loop = _side_bytes(k_bits, block_n, head_dim, group_size, True) + _side_bytes(v_bits, block_n, head_dim,
                                                                                 group_size, False)
    return StaticSpec(fn, sig, const, (*ptrs, "tokens_per_split", "P"), td.NUM_WARPS, td.NUM_STAGES,
                      td.max_registers(head_dim), loop)


def _tool(name: str) -> str:
    from triton.backends.nvidia import compiler

    path = Path(compiler.__file__).parent / "bin" / name
    if not path.is_file():
        raise MoendError(f"the static report needs {name} from Triton's wheel; not found at {path}")
    return str(path)


def compile_cubin(k_bits: int, v_bits: int, head_dim: int, gqa: int, arch: int = 90):
    """(cubin bytes, shared bytes, the variant's :class:`StaticSpec`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = static_spec(k_bits, v_bits, head_dim, gqa)
    attrs = {(spec.fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible}
    src = ASTSource(spec.fn, spec.signature, spec.constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages, maxnreg=spec.maxnreg))
    return compiled.asm["cubin"], int(compiled.metadata.shared), spec


def _resources(cubin_path: str) -> dict[str, int]:
    text = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin_path], check=True, capture_output=True,
                          text=True).stdout
    found = {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|STACK):(\d+)", text)}
    return {"registers": found.get("REG", 0), "local_bytes": found.get("LOCAL", 0) + found.get("STACK", 0)}


def main_loop(sass: str) -> list[str]:
    """Opcodes of the first loop (a backward branch to an earlier label) that holds an HMMA/WGMMA dot."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    ops: list[tuple[int, str]] = []  # (line, opcode)
    for i, line in enumerate(lines):
        if m := _LABEL.match(line):
            labels[m.group(1)] = i
        elif m := _OPCODE.match(line):
            ops.append((i, m.group(1)))
    for i, line in enumerate(lines):
        b = _BRANCH.search(line)
        if b and labels.get(b.group(1), i) < i:
            body = [op for ln, op in ops if labels[b.group(1)] < ln <= i and op != "NOP"]
            if any(op.startswith(("HMMA", "HGMMA")) for op in body):
                return body
    raise MoendError("no loop with a tensor-core dot in the SASS: cannot find the main loop")


def analyse(k_bits: int, v_bits: int, head_dim: int, gqa: int, arch: int, sass_dir: Path) -> StaticFigures:
    """Compile one variant for sm_<arch>, write its SASS to ``sass_dir`` and read its figures."""
    from moend_fx.kernels.variants import variant_name

    cubin, shared, spec = compile_cubin(k_bits, v_bits, head_dim, gqa, arch)
    name = variant_name(k_bits, v_bits, head_dim, spec.constexprs["GROUP"]) + f"_gq{gqa}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = _resources(str(path))
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout
    atomic_write_text(sass_dir / f"{name}_sm{arch}.sass", sass)
    body = main_loop(sass)
    ops = Counter(body)
    loads = Counter(op for op in body if op.startswith("LDG"))
    return StaticFigures(
        variant=name, arch=arch, shared_bytes=shared, num_warps=spec.num_warps, block_n=spec.constexprs["BLOCK_N"],
        loop_instructions=len(body), loop_bytes=spec.loop_bytes,
        instr_per_byte=round(len(body) * spec.num_warps / spec.loop_bytes, 4),
        loop_i2f=sum(n for op, n in ops.items() if op.startswith("I2F")),
        loop_dot={op: n for op, n in ops.items() if op.startswith(("HMMA", "HGMMA"))},
        loop_loads=dict(loads), **res)


def to_markdown(rows: list[StaticFigures]) -> str:
    head = ("| variant | sm | regs | local B | shared B | warps | BLOCK_N | loop instr | loop bytes | instr/byte "
            "| I2F in loop | dot in loop |\n" + "| --- " * 12 + "|\n")
    body = "".join(
        f"| {r.variant} | {r.arch} | {r.registers} | {r.local_bytes} | {r.shared_bytes} | {r.num_warps} | "
        f"{r.block_n} | {r.loop_instructions} | {r.loop_bytes} | {r.instr_per_byte:.3f} | {r.loop_i2f} | "
        f"{', '.join(f'{k} x{v}' for k, v in r.loop_dot.items())} |\n" for r in rows)
    return head + body


def static_report(out: str | Path, variants=SHIPPED, archs=ARCHS) -> tuple[str, dict[str, Path]]:
    """Compile ``variants`` for ``archs``; write ``static.json``, ``static.md`` and ``sass/*.sass`` under ``out``."""
    out = Path(out)
    rows = [analyse(*v, arch, out / "sass") for v in variants for arch in archs]
    md = to_markdown(rows)
    files = {"json": atomic_write_text(out / "static.json", json.dumps([asdict(r) for r in rows], indent=1) + "\n"),
             "markdown": atomic_write_text(out / "static.md", md), "sass": out / "sass"}
    return md, files
