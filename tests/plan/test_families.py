"""moend_fx.plan.families: a family moend_fx cannot serve is refused by one PlanError naming the family and the
reason, before calibration or prepare could fail on a shape deep inside; every family of the matrix is served."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Gemma2Config, GptOssConfig, GptOssForCausalLM, LlamaConfig

from moend_fx import calibrate, prepare
from moend_fx.common.errors import PlanError
from moend_fx.models import tiny_model
from moend_fx.models.tiny import TINY_CONFIGS
from moend_fx.plan.families import FAMILIES, check_family, family_of, refusal
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def _gpt_oss():
    cfg = GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"] * 2)
    cfg._attn_implementation = "eager"  # GPT-OSS has no SDPA path in transformers (its sinks)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GptOssForCausalLM(cfg).eval()


def test_gpt_oss_is_refused_by_one_error_naming_the_family_and_its_sinks():
    model = _gpt_oss()
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 64)
    for call in (lambda: prepare(model, plan), lambda: calibrate(model, token_ids=torch.randint(0, 64, (1, 64)))):
        with pytest.raises(PlanError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith("moend_fx cannot serve 'gpt_oss' models (GptOssForCausalLM)")
        assert "learned attention sinks" in msg and "docs/models.md" in msg
    assert model.config._attn_implementation == "eager"  # refused before anything changed


@pytest.mark.parametrize("cfg, words", [
    (LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}),
     ["partial rotary", "3 of 16 channels"]),
    (types.SimpleNamespace(model_type="hybrid", num_attention_heads=4, hidden_size=64,
                           layer_types=["full_attention", "linear_attention"]), ["'hybrid'", "linear_attention"]),
    (types.SimpleNamespace(model_type="falcon", alibi=True, num_attention_heads=4, hidden_size=64), ["ALiBi"]),
])
def test_structural_refusals_name_the_family_and_the_reason(cfg, words):
    with pytest.raises(PlanError) as err:
        check_family(cfg)
    for w in words:
        assert w in str(err.value)


def test_soft_capping_is_served():
    assert refusal(Gemma2Config(**SMALL)) is None  # attn_logit_softcapping=50.0: moend_fx.cache.hf_attention


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_every_family_of_the_matrix_is_served(family):
    model = tiny_model(family, num_heads=4, num_kv_heads=4, head_dim=16)
    assert refusal(model) is None
    check_family(model)
    row = family_of(model)
    assert row is not None and row.refused is None and row.model_type in FAMILIES
