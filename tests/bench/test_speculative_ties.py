"""moend_fx.bench.speculative_ties: the comparison finds the first differing token and the gaps at it, and one
prompt on a tiny model gives a row per variant with the decode-time evictions counted."""

from __future__ import annotations

import torch

from moend_fx.bench.speculative_ties import TieSettings, compare, measure_prompt, ties_markdown
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan


def test_compare_finds_the_difference_and_its_gaps():
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(10, generator=g) for _ in range(4)]
    ref = (torch.stack([s.argmax() for s in scores]), scores)
    same = compare(ref, (ref[0].clone(), [s.clone() for s in scores]))
    assert same["first_difference"] is None and same["drift_max"] == 0
    moved = [s.clone() for s in scores]
    second = int(scores[2].topk(2).indices[1])
    moved[2][second] = scores[2].max() + 0.25  # the runner-up overtakes by 0.25 at token 2
    moved[0][0] += 1e-3
    got = (torch.stack([s.argmax() for s in moved]), moved)
    row = compare(ref, got)
    assert row["first_difference"] == 2 and row["drift_max"] > 0.25 - 1e-6
    top = scores[2].topk(2).values
    assert abs(row["plain_gap"] - float(top[0] - top[1])) < 1e-6 and abs(row["variant_gap"] - 0.25) < 1e-6


def test_one_prompt_gives_a_row_per_variant():
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    draft = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    draft.load_state_dict(model.state_dict())
    draft.generation_config.num_assistant_tokens = 3
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 48, group_size=8,
                               scorer="snapkv")
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    rows = measure_prompt(model, draft, ids, plan, TieSettings(new_tokens=16), None)
    assert [(r["cache"], r["variant"]) for r in rows] == [
        ("DynamicCache", "prompt lookup"), ("MoENDCache", "prompt lookup"), ("MoENDCache", "assisted")]
    assert rows[0]["first_difference"] is None and rows[0]["drift_max"] < 1e-4  # fp32: chunking is rounding only
    assert all(r["decode_evictions"] > 0 for r in rows[1:])  # the 48-token plan evicts while decoding
    assert "| 40 | MoENDCache | assisted |" in ties_markdown({"rows": rows})
