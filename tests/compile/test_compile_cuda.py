"""The whole stack on a CUDA GPU, where torch sees one (the CPU CI has none, so these skip there; they are run on
a GPU machine by hand, see docs/kernels.md): MoENDCache in ``generate`` on CUDA tensors, whose decode steps run
the Triton kernel through the fused op, against the same model on the CPU; and ``model.compile(backend="moend")``
with inductor generating GPU code, which gives the eager tokens with the quantized layers fused."""

import pytest
import torch

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.plan.routing import LayerConfig
from tests.compile.test_compile_generate import _eager_then_compiled, _model, _packed_nodes, _plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")

CONFIGS = (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2))


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_cuda_compiled_generate_matches_eager_and_fuses_every_quantized_layer():
    model = _model().to("cuda")
    plan = _plan(model, CONFIGS)
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(
        model, plan, _ids(1, 80).to("cuda"), 40, inner="inductor", scorer="keynorm", evict_every=16,
        budget_mode="ratio")
    # eager and compiled decode steps both call the same Triton kernel (fp16 operands, fp32 accumulation) on the
    # same inputs: same tokens
    assert torch.equal(got, want)
    assert len(graphs) == 1
    assert sorted(n.meta["moend_layer"] for n in _packed_nodes(graphs[0])) == [0, 2]
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()
    assert got_cache.layers[0].evictions == want_cache.layers[0].evictions >= 1
    stored = [t for layer in got_cache.layers for t in layer.stored_tensors()]
    assert stored and all(t.device.type == "cuda" for t in stored)


def _scores(model: torch.nn.Module, ids: torch.Tensor, plan) -> torch.Tensor:
    prepare(model, plan, scorer="keynorm", evict_every=16, budget_mode="ratio")
    try:
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    finally:
        unprepare(model)
    return torch.stack(out.logits).float().cpu()


def test_cuda_eager_decode_matches_the_cpu_model():
    """The same prompt and plan on the CPU (C++ kernel) and on CUDA (Triton kernel): next-token logits agree."""
    model = _model()
    plan = _plan(model, CONFIGS)
    cpu = _scores(model, _ids(2, 80), plan)
    gpu = _scores(model.to("cuda"), _ids(2, 80).to("cuda"), plan)
    # fp32 model on both, but the Triton kernel rounds q*s, each dequantized k and v and each probability to fp16
    # (2^-11 relative, docs/kernels.md "Precision"), the CPU kernel rounds q*s to int16 per K group
    # (moend_fx.kernels.precision), and cuBLAS and MKL sum in other orders. This tiny model's |v| < ~2 and
    # |logit| < 1: each attention output moves by at most ~3 x 2^-11 x 2 = 3e-3, hence 5e-3 (the bound is
    # reasoned, not yet measured on a GPU: the fp16 kernel of 2026-12-07 has not met one)
    torch.testing.assert_close(gpu, cpu, atol=5e-3, rtol=1e-3)
