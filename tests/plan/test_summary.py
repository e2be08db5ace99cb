from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.plan.summary import plan_summary

FP = ModelFingerprint("LlamaForCausalLM", 5, 2, 16, 4, "float32")


def test_plan_summary_counts_configs_most_used_first():
    a, b, c = LayerConfig(0.25, 4, 4), LayerConfig(1.0, 8, 8), LayerConfig(0.5, 16, 16)
    plan = RoutingPlan(layers=(b, a, a, c, a), fingerprint=FP, budget_bytes=1, context_length=64)
    assert plan_summary(plan) == "3x keep 0.25/K4/V4, 1x keep 1/K8/V8, 1x keep 0.5/K16/V16"  # ties: first seen
    assert plan_summary(RoutingPlan.uniform(a, FP, 64)) == "5x keep 0.25/K4/V4"
