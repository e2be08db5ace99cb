"""Every byte a MoENDCache holds is counted: walking every tensor reachable from the cache (its layers, their
storage, the eviction state), each tensor's whole underlying storage counted once (a view keeps its base
alive), gives exactly ``cache.nbytes()`` and the memory model's ``cache.model_bytes()``, right after the
prefill and after 300 and 1000 decode steps, for every registered scorer (trig with and without calibrated
statistics)."""

from __future__ import annotations

import types

import pytest
import torch

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import SCORERS
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

_SKIP = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, type, types.ModuleType,
         types.FunctionType, types.MethodType, types.BuiltinFunctionType, torch.nn.Module)


def reachable_storage_bytes(root: object) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` through attributes and containers."""
    seen: set[int] = set()
    storages: dict[tuple[int, int], int] = {}
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
        elif isinstance(o, dict):
            stack += [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        else:
            stack += list(getattr(o, "__dict__", {}).values())
            stack += [getattr(o, s) for s in getattr(type(o), "__slots__", ()) if hasattr(o, s)]
    return sum(storages.values())


def test_the_walk_counts_a_views_whole_base():
    base = torch.zeros(100)
    assert reachable_storage_bytes({"a": [base[:10]]}) == 400
    assert reachable_storage_bytes((base[:10], base[50:])) == 400  # one storage, counted once
    assert reachable_storage_bytes(types.SimpleNamespace(x=torch.ones(3, dtype=torch.float16))) == 6


def _model():
    return tiny_model("llama", num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16, seed=1)


def _stats(model) -> list[QueryStats]:
    g = torch.Generator().manual_seed(0)
    fp = ModelFingerprint.from_model(model)
    return [QueryStats.empty(fp.num_heads, fp.head_dim).accumulate(torch.randn(1, fp.num_heads, 40, fp.head_dim,
                                                                               generator=g))
            for _ in range(fp.num_layers)]


CASES = [(name, False) for name in sorted(SCORERS)] + [("trig", True), ("snapkv_trig", True)]


@pytest.mark.parametrize("scorer,calibrated", CASES, ids=[f"{n}{'-stats' if c else ''}" for n, c in CASES])
@torch.no_grad()
def test_walked_bytes_equal_nbytes_and_the_memory_model(scorer, calibrated):
    model = _model()
    fp = ModelFingerprint.from_model(model)
    layers = (LayerConfig(0.25, 4, 8), LayerConfig(1.0, 8, 4), LayerConfig(0.5, 16, 4))
    plan = RoutingPlan(layers=layers, fingerprint=fp, budget_bytes=1, context_length=1300, scorer=scorer)
    cache = MoENDCache(plan, rope=rope_from_model(model), query_stats=_stats(model) if calibrated else None,
                       evict_every=64)
    ids = torch.randint(3, 256, (2, 150), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("moend")
    try:
        logits = model(ids, cache=cache, use_cache=True).logits
        checked = []
        for step in range(1001):
            if step in (0, 300, 1000):
                total = cache.nbytes().total
                assert reachable_storage_bytes(cache) == total == cache.model_bytes().total, (scorer, step)
                checked.append(total)
            if step < 1000:
                tok = logits[:, -1:].argmax(-1)
                logits = model(tok, cache=cache, use_cache=True).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.layers[0].evictor.evictions > 10  # re-evicted along the way: the walk saw evicted storage
    assert len(checked) == 3 and checked[2] > checked[0]
    reads_queries = SCORERS[scorer].reads_queries(calibrated=calibrated)
    assert (cache.layers[0].evictor.window.nbytes() > 0) == reads_queries
    assert cache.layers[1].state_nbytes() == 0  # keeps every token: no eviction state at all
