"""End to end on a tiny HF model: prepare -> model.compile(backend="moend") -> generate gives the eager tokens,
with the quantized layers' attention fused and no graph break."""

import collections
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from moend_fx.graph_attention import packed_layer_attention
from moend_fx.models import tiny_model
from moend_fx.plan import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.prepare import prepare, unprepare


class Fused(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.variants = collections.Counter()

    def emit(self, record):
        msg = record.getMessage()
        if "fused into" in msg:
            self.variants[msg.split("fused into ")[1].split("_layer")[0]] += 1


@pytest.fixture
def fused_log():
    h = Fused()
    logger = logging.getLogger("moend_fx.passes")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(h)
    yield h
    logger.removeHandler(h)
    logger.setLevel(old)


def test_compiled_generate_matches_eager(fused_log):
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    plan = RoutingPlan(layers=(LayerConfig(1.0, 4, 8), LayerConfig(1.0, 16, 16)),
                       fingerprint=ModelFingerprint.from_model(model), budget_bytes=1, context_length=128)
    prepare(model, plan, attention_fn=packed_layer_attention)
    # 60-token prompt: the residual window holds 28 tokens, so the 4th new token flushes a group of 32.
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want = model.generate(ids, **gen)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile(backend="moend", options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        got = model.generate(ids, **gen)
    finally:
        torch._dynamo.reset()
        model._compiled_call_impl = None
        unprepare(model)
    # Greedy tokens agree exactly: the fused kernel differs from SDPA only in fp32 summation order.
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    # Layer 0 (k4/v8) is fused in every decode graph; layer 1 (16/16) never is.
    assert set(fused_log.variants) == {"attn_k4_v8_hd16_g32"}
    assert fused_log.variants["attn_k4_v8_hd16_g32"] >= 1
