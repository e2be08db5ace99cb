"""The Triton decode kernel's static line, held on a machine without a GPU: compiled for sm_90 by the ptxas that
Triton's wheel bundles (moend_fx.kernels.static_report), its SASS must show no local memory (spills), no
int-to-float conversion in the main loop, fp16 tensor-core dots (HMMA.16816.F32, not the TF32 form), and k4v4 at or
under 0.30 warp-instructions per HBM byte (the H200 affords ~0.2; the kernel before this line issued 0.92)."""

from __future__ import annotations

import os

import pytest

from moend_fx.kernels import static_report

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the static report compiles for a GPU; the interpreter gives no cubin")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   NOP ;
        /*0030*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   I2F R0, R1 ;
        /*0060*/                   BRA `(.L_x_1);
"""


def test_main_loop_is_the_first_backward_branch_with_a_dot():
    # the first loop (with the dot) counts 3 instructions, NOP excluded; the trailing self-loop has no dot
    assert static_report.main_loop(SASS) == ["LDG.E.128", "HMMA.16816.F32", "BRA"]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    # k8v4 is here because ptxas once spilled it (fixed by the launch's register cap, triton_decode.max_registers)
    return {pair: static_report.analyse(*pair, 64, 3, 90, out) for pair in ((2, 2), (4, 4), (8, 8), (8, 4))}


def test_no_spills_no_i2f_and_fp16_tensor_core_dots(figures):
    for pair, f in figures.items():
        assert f.local_bytes == 0, (pair, f)
        assert f.loop_i2f == 0, (pair, f)
        assert f.loop_dot and all(op.startswith("HMMA.16816.F32") for op in f.loop_dot), (pair, f.loop_dot)
        assert not any("TF32" in op for op in f.loop_dot)


def test_k4v4_issues_at_most_030_warp_instructions_per_byte(figures):
    f = figures[4, 4]
    # one step reads 128 tokens x (32 B of K codes + 32 B of V codes) + 4 K groups' and 128 tokens' fp16 scale/zero
    assert f.loop_bytes == 128 * 64 + 4 * 64 * 4 + 128 * 2 * 4
    assert f.instr_per_byte <= 0.30, f


def test_sass_written_beside(figures, tmp_path):
    md, files = static_report.static_report(tmp_path, variants=((4, 4, 64, 3),), archs=(90,))
    assert (tmp_path / "sass" / "attn_k4_v4_hd64_g32_gq3_sm90.sass").read_text().count("HMMA") > 0
    assert "attn_k4_v4_hd64_g32_gq3" in md and files["json"].is_file()
