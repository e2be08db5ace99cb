"""The Triton decode op inside a captured CUDA graph (needs a GPU: skipped in CI, run by .ci/gpu): after one
warm-up call (which makes the split tickets), a decode call is captured and replayed, with several splits merged
in the launch and with one, and gives the eager call's output; the tickets are back at 0 after each replay."""

from __future__ import annotations

import pytest
import torch

from moend_fx.kernels import layer_tensors, triton_decode
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_call_replays_in_a_cuda_graph(splits):
    gen = torch.Generator().manual_seed(splits)
    k, v = torch.randn(2, 3, 4 * 128 + 9, 64, generator=gen), torch.randn(2, 3, 4 * 128 + 9, 64, generator=gen)
    layer = PackedKV.from_dense(k.half(), v.half(), LayerConfig(1.0, 4, 4), 32).map(lambda t: t.cuda())
    q = torch.randn(2, 9, 1, 64, generator=gen).half().cuda()

    def step():
        return triton_decode.packed_attention_triton(q, *layer_tensors(layer), 4, 4, 32, 0.125, True,
                                                     num_splits=splits)

    want = step()  # warm-up: compiles the kernel and makes the tickets outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)  # same kernel, same inputs, same order of the split merge: bit for bit
    assert triton_decode._tickets(1, q.device).abs().sum().item() == 0
