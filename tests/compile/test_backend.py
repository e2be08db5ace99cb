"""The ``moend`` backend: registration (import and entry point), options, inner compilers, debug dumps."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from moend_fx.attention.packed import packed_layer_attention
from moend_fx.common.errors import MoendError, PlanError
from moend_fx.common.options import InnerCompiler, Kernel
from moend_fx.compile.backend import compile_inner, graph_device_type, moend_backend
from moend_fx.compile.settings import AUTO_INNER, BackendSettings, resolve_inner, resolve_plan
from moend_fx.kernels import packed_attention
from moend_fx.kernels.precision import FP32_ATOL, FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.storage.packed import PackedKV


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layer(k_bits=4, v_bits=8, n=70):
    return PackedKV.from_dense(rand(1, 2, n, 8), rand(1, 2, n, 8, seed=1), LayerConfig(1.0, k_bits, v_bits), 32)


def plan(*configs):
    fp = ModelFingerprint("Toy", len(configs), 2, 8, 4)
    return RoutingPlan(layers=configs, fingerprint=fp, budget_bytes=1, context_length=64)


def attend(q, kv):
    return packed_layer_attention(q, kv) * 2


def compiled(options, fn=attend):
    torch._dynamo.reset()
    return torch.compile(fn, backend="moend", options=options, fullgraph=True)


def test_registered_under_its_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("moend") is moend_backend
    assert "moend" in torch._dynamo.list_backends()


def test_entry_point_finds_the_backend_without_importing_moend_fx():
    code = textwrap.dedent("""
        import sys, torch
        out = torch.compile(lambda x: x * 2, backend="moend", options={"inner": "eager"})(torch.ones(3))
        assert out.tolist() == [2.0, 2.0, 2.0], out
        assert "moend_fx.compile.backend" in sys.modules  # loaded by dynamo through the entry point
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
def test_compiled_equals_eager_and_is_fused(inner, tmp_path):
    q, kv = rand(1, 4, 1, 8, seed=3), layer()
    out = compiled({"inner": inner, "plan": plan(LayerConfig(1.0, 4, 8)), "debug_dir": str(tmp_path),
                    "require_all_layers": True})(q, kv)
    # fused kernel vs SDPA over dequantized values: the kernel dots K codes against q rounded to int16 per group
    # (moend_fx.kernels.precision: 3 sigma of that rounding, plus fp32 summation order)
    torch.testing.assert_close(out, attend(q, kv), atol=kernel_atol(q, kv), rtol=FP32_RTOL)
    before = sorted(tmp_path.glob("graph_*_before.txt"))
    after = sorted(tmp_path.glob("graph_*_after.txt"))
    assert len(before) == len(after) == 1
    assert "moend.dequantize" in before[0].read_text() and "moend.dequantize" not in after[0].read_text()
    assert "attn_k4_v8_hd8_g32_layer0" in after[0].read_text()


def append_and_attend(q, kv, k_new, v_new):
    grown = kv.append(k_new, v_new)  # 63 + 1 tokens: flushes a group of 32 inside the graph
    return attend(q, grown), grown.k_packed.codes, grown.k_packed.scale, grown.v_packed.codes, grown.v_packed.zero


def test_inductor_inner_compiler_attends_and_flushes_bit_exactly():
    q, kv = rand(1, 4, 1, 8, seed=4), layer(8, 2, n=63)
    new = rand(1, 2, 1, 8, seed=5), rand(1, 2, 1, 8, seed=6)
    got = compiled({"inner": "inductor"}, append_and_attend)(q, kv, *new)
    want = append_and_attend(q, kv, *new)
    # The compiled graph attends with the fused kernel, eager with SDPA over dequantized values: the kernel's
    # int16 rounding of q*s (moend_fx.kernels.precision: 3 sigma of it, over the grown layer) plus fp32 order.
    grown = kv.append(*new)
    torch.testing.assert_close(got[0], want[0], atol=kernel_atol(q, grown), rtol=FP32_RTOL)
    # and against the kernel called directly on the grown layer: fp32 summation order only
    torch.testing.assert_close(got[0], packed_attention(q, grown, kernel="cpu") * 2, atol=FP32_ATOL, rtol=FP32_RTOL)
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w)  # the flushed group's codes, scales and zeros are eager's, bit for bit


def test_plan_mismatch_surfaces_as_plan_error():
    with pytest.raises(BackendCompilerFailed) as e:
        compiled({"inner": "eager", "plan": plan(LayerConfig(1.0, 8, 8))})(rand(1, 4, 1, 8), layer())
    assert isinstance(e.value.inner_exception, PlanError)
    assert "plan says k_bits=8" in str(e.value)


@pytest.mark.parametrize("options, msg", [
    ({"inner": "tvm"}, "inner='tvm' is unknown; allowed: auto, inductor, aot_eager, eager"),
    ({"kernel": "cuda"}, "kernel='cuda' is unknown; allowed: auto, cpu, triton, reference"),
    ({"fullgraph": True}, "unknown moend backend option(s) ['fullgraph']; allowed: ['plan'"),
    ({"fuse": "yes"}, "fuse='yes' is invalid; allowed: True or False"),
    ({"plan": 3}, "plan=int object is not a plan; allowed: a RoutingPlan"),
    ({"debug_dir": 5}, "debug_dir=5 is invalid"),
])
def test_bad_options_raise_moend_error(options, msg):
    with pytest.raises(MoendError) as e:
        BackendSettings.from_options(options)
    assert msg in str(e.value)
    # Through torch.compile the same error arrives wrapped by dynamo (raised at the first call).
    with pytest.raises(BackendCompilerFailed) as e:
        compiled(options)(rand(1, 4, 1, 8), layer())
    assert isinstance(e.value.inner_exception, MoendError) and msg in str(e.value)


def test_settings_object_and_overrides():
    s = BackendSettings(inner="eager", kernel="reference")
    # Plain strings are stored as the enum members, which still compare equal to the strings.
    assert s.inner is InnerCompiler.EAGER and s.kernel is Kernel.REFERENCE and s.inner == "eager"
    assert BackendSettings.from_options(s) == s
    assert BackendSettings.from_options(s, inner="aot_eager").inner == "aot_eager"
    assert BackendSettings.from_options(None, mode="reduce-overhead").mode == "reduce-overhead"
    with pytest.raises(MoendError, match="allowed: a dict, BackendSettings or None"):
        BackendSettings.from_options([("inner", "eager")])


def test_auto_inner_compiler_is_resolved_per_device():
    assert BackendSettings().inner is InnerCompiler.AUTO  # the default
    assert resolve_inner("auto", "cpu") is AUTO_INNER["cpu"]
    assert resolve_inner("auto", "cuda") is InnerCompiler.INDUCTOR  # Triton code generation, CUDA graphs
    assert resolve_inner("auto", "xpu") is InnerCompiler.INDUCTOR  # a device without a measurement
    assert resolve_inner("auto", "cpu", mode="max-autotune") is InnerCompiler.INDUCTOR  # only inductor reads mode
    for inner in ("inductor", "aot_eager", "eager"):  # a named compiler is used on any device
        assert resolve_inner(inner, "cuda") == resolve_inner(inner, "cpu") == inner
    with pytest.raises(MoendError, match="allowed: auto, inductor"):
        resolve_inner("tvm", "cpu")


def test_graph_device_type_prefers_cuda_and_skips_non_tensors():
    meta = torch.empty(2, device="meta")
    assert graph_device_type([3, torch.ones(2)]) == "cpu"
    assert graph_device_type([meta, torch.ones(2)]) == "meta"
    assert graph_device_type([]) == "cpu"
    if torch.cuda.is_available():
        assert graph_device_type([torch.ones(2), torch.ones(2, device="cuda")]) == "cuda"


def test_auto_hands_a_cpu_graph_to_the_measured_choice(monkeypatch):
    """compile_inner resolves ``auto`` with the graph's device: on CPU, what AUTO_INNER names (here swapped for
    ``eager``, which returns the graph's own forward, so the choice is visible)."""
    gm = torch.fx.symbolic_trace(lambda x: (x * 2,))  # tuple output, as dynamo's graphs have
    x = rand(3)
    monkeypatch.setitem(AUTO_INNER, "cpu", InnerCompiler.EAGER)
    assert compile_inner(gm, [x], BackendSettings()) == gm.forward
    monkeypatch.setitem(AUTO_INNER, "cpu", InnerCompiler.AOT_EAGER)
    fn = compile_inner(gm, [x], BackendSettings())
    assert fn != gm.forward and torch.equal(fn(x)[0], x * 2)


def test_plan_found_from_model_cache_or_file(tmp_path):
    p = plan(LayerConfig(1.0, 4, 8))

    class Prepared(torch.nn.Module):
        moend_plan = p

    class Cache:
        plan = p

    path = p.save(tmp_path / "plan.json")
    assert resolve_plan(Prepared()) is p and resolve_plan(Cache()) is p
    assert resolve_plan(str(path)) == p and resolve_plan(path) == p
    assert BackendSettings(plan=Cache()).plan is p
    with pytest.raises(PlanError, match="does not exist"):
        resolve_plan(tmp_path / "missing.json")
