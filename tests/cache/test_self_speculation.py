"""moend_fx.cache.self_speculation: a model drafting over its compressed cache and verifying over its full cache
decodes what greedy decoding over the full cache decodes, in every row of a batch, with the draft cache within its
budget."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.self_speculation import self_speculative_generate
from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan


@pytest.mark.parametrize("cfg", [LayerConfig(0.5, 4, 4), LayerConfig(0.25, 2, 2)])
@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
def test_self_speculation_decodes_the_full_caches_greedy_tokens(cfg, draft_tokens):
    """fp32 tiny model: the verified tokens are the full cache's greedy tokens exactly (no near-ties here), on
    three prompts; a harsher plan drafts worse (fewer accepted), never wrong; the draft cache keeps its budget."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    plan = RoutingPlan.uniform(cfg, ModelFingerprint.from_model(model), 64, group_size=8, scorer="snapkv")
    for seed in range(3):
        ids = torch.randint(3, 256, (1, 60 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        want = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0,
                              cache=DynamicCache(config=model.config))[:, ids.shape[1]:]
        prepare(model, plan)
        res = self_speculative_generate(model, ids, plan, max_new_tokens=30, draft_tokens=draft_tokens,
                                        rope=rope_from_model(model))
        unprepare(model)
        assert torch.equal(res.tokens, want), (res.tokens.tolist(), want.tolist())
        assert 0 <= res.accepted <= res.drafted and res.rounds >= 30 // (draft_tokens + 1)
        cache = res.draft_cache
        assert cache.nbytes().total <= cache.budget_bytes().total and cache.nbytes() == cache.model_bytes()


@torch.no_grad()
def _greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """[1, n] greedy tokens after ids [1, T] over a DynamicCache, one by one (no EOS handling: generate's
    min_new_tokens would mask the tiny model's EOS id 2, which is some rows' greedy token)."""
    cache, out = DynamicCache(config=model.config), [ids]
    for _ in range(n):
        out.append(model(out[-1], cache=cache, use_cache=True).logits[:, -1:].argmax(-1))
    return torch.cat(out[1:], 1)


@pytest.mark.parametrize("mode", ["ratio", "capacity"])
def test_a_batch_decodes_each_rows_own_greedy_tokens(mode):
    """Four unpadded rows of different random tokens (fp32 tiny model, 3 drafts a round, evictions every 4 decode
    steps in ratio mode, a 48-token capacity plan): every row's tokens equal that row's greedy decoding alone over
    the full cache; the batch keeps each round's shortest match, so its acceptance is at most the rows' own."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 48, group_size=8,
                               scorer="snapkv")
    ids = torch.randint(3, 256, (4, 50), generator=torch.Generator().manual_seed(7))
    want = torch.cat([_greedy(model, row[None], 24) for row in ids])
    prepare(model, plan)
    try:
        res = self_speculative_generate(model, ids, plan, max_new_tokens=24, draft_tokens=3, budget_mode=mode,
                                        evict_every=4, rope=rope_from_model(model))
    finally:
        unprepare(model)
    assert torch.equal(res.tokens, want), (res.tokens.tolist(), want.tolist())
    assert 0 < res.acceptance <= res.row_acceptance <= 1 and res.rounds >= 24 // 4
    assert res.draft_cache.get_seq_length() == 50 + 23  # the last token is never fed
    assert res.draft_cache.nbytes() == res.draft_cache.model_bytes()
    if mode == "capacity":
        assert res.draft_cache.nbytes().total <= res.draft_cache.budget_bytes(batch=4).total


def test_self_speculation_refuses_what_it_cannot_do():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 64, scorer="snapkv")
    ids = torch.randint(3, 256, (2, 20))
    with pytest.raises(MoendError, match=r"ids must be \[B, T\]"):
        self_speculative_generate(model, ids[0], plan, max_new_tokens=4)
    with pytest.raises(MoendError, match="needs the 'moend' attention"):
        self_speculative_generate(model, ids[:1], plan, max_new_tokens=4)
    with pytest.raises(MoendError, match="draft_tokens=0 is invalid"):
        self_speculative_generate(model, ids[:1], plan, max_new_tokens=4, draft_tokens=0)
