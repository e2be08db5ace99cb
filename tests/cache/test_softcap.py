"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): the "moend" attention caps the logits of the
prompt's attention and of every later chunk and decode step (reference attention over the compressed layer), eager
and compiled (the capped layers are not fused: the fused kernels do not cap)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.models import uncompile
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from tests.models.test_families import _fused_layers, _Recording

# tiny random weights give logits of ~1e-2: a cap far below that changes the model's output measurably
CAP = 0.002


def _gemma2(cap: float | None):
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=cap,
                       final_logit_softcapping=None, layer_types=["full_attention"] * 2, sliding_window=4096)
    cfg._attn_implementation = "eager"  # transformers' SDPA path ignores soft-capping
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Gemma2ForCausalLM(cfg).eval()


def _ids():
    return torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))


def _generate(model, n=6, **kw):
    return model.generate(_ids(), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kw)


def test_the_lossless_plan_caps_the_prompt_and_every_step_as_the_model_does():
    model, uncapped = _gemma2(CAP), _gemma2(None)
    want = _generate(model, cache=DynamicCache(config=model.config))
    plan = RoutingPlan.uniform(LayerConfig(1.0, 16, 16), ModelFingerprint.from_model(model), 64)
    prepare(model, plan)
    try:
        got = _generate(model)
    finally:
        unprepare(model)
    assert torch.equal(got.sequences, want.sequences)
    gap = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    with torch.no_grad():
        effect = (model(_ids()).logits - uncapped(_ids()).logits).abs().max().item()
    # the lossless plan stores K/V in fp16 (gap ~1e-4); ignoring the cap would move the logits by `effect` (~1e-2)
    assert gap < 0.1 * effect, (gap, effect)


def test_compiled_soft_capped_layers_give_the_eager_tokens_unfused():
    model = _gemma2(CAP)
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 64)
    backend = _Recording()
    try:
        prepare(model, plan, scorer="keynorm")
        want = _generate(model, 12).sequences
        torch._dynamo.reset()
        counters.clear()
        model.compile(backend=backend, options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        got = _generate(model, 12).sequences
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    assert torch.equal(got, want) and sum(counters["graph_break"].values()) == 0
    assert _fused_layers(backend.graphs) == set()  # the fused kernels do not cap: the reference attention runs
