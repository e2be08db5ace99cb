"""No drift: decode-time re-evictions of a layer with quantized K drop whole packed groups, so every surviving K code
keeps its group's scale and zero and the K error stays that of the first quantization (the old way, dequantize
the survivors and quantize them again, grows it round after round: the control below shows the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from moend_fx.cache.layer import EvictionPolicy, MoENDLayer
from moend_fx.eviction.evictor import Evictor
from moend_fx.eviction.groups import groups_to_keep
from moend_fx.eviction.scorers import get_scorer
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

CFG = LayerConfig(0.25, 4, 4)


def test_groups_to_keep_keeps_the_groups_holding_the_best_tokens():
    ranks = torch.tensor([[[5, 9, 0, 7, 8, 6, 1, 2, 3, 4]]])  # 2 groups of 4 packed, then 2 residual
    assert groups_to_keep(ranks[..., :8], 8, 4, 1).tolist() == [[[0]]]  # group 0 holds rank 0
    assert groups_to_keep(ranks[..., :8], 8, 4, 0).tolist() == [[[0, 1]]]


def _k_error(packed: PackedKV, originals: torch.Tensor) -> float:
    """Relative error of the packed (quantized) K tokens against their original values originals [B, H, S, D]."""
    p = packed.num_packed
    k, _ = packed.dequantize()
    pos = packed.positions[..., :p].long()
    orig = originals.gather(2, pos[..., None].expand(*pos.shape, originals.shape[-1]))
    return float((k[:, :, :p] - orig).norm() / orig.norm())


def _drift(keys: torch.Tensor, rounds: int = 8) -> tuple[float, float]:
    """(K error after the prompt's quantization, after ``rounds`` decode-time re-evictions) of a keep-0.25 K4/V4
    layer fed keys [1, H, S, D]: the first T = S // 2 as the prompt, the rest one decode step at a time."""
    _, h, s, d = keys.shape
    t = s // 2
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(keys.shape, generator=gen)
    layer = MoENDLayer(CFG, layer_idx=0, scorer=get_scorer("keynorm"),
                       policy=EvictionPolicy(evict_every=16, sink_tokens=4, recent_tokens=8))
    layer.update(keys[:, :, :t], values[:, :, :t])
    layer.finish_prefill(torch.randn(1, h, t, d, generator=gen), None)
    first = _k_error(layer.packed, keys)
    done = layer.evictions
    step = t
    while layer.evictions < done + rounds:
        assert step < s, "ran out of keys before the re-evictions happened"
        layer.update(keys[:, :, step : step + 1], values[:, :, step : step + 1])
        layer.attend(torch.randn(1, h, 1, d, generator=gen), None)
        step += 1
    layer.settle()
    return first, _k_error(layer.packed, keys)


def _keys(s: int, seed: int) -> torch.Tensor:
    k = torch.randn(1, 2, s, 64, generator=torch.Generator().manual_seed(seed))
    return k * torch.linspace(0.2, 4.0, 64)  # channel outliers, as real K has


@pytest.mark.parametrize("seed", [0, 1])
def test_k_error_after_8_re_evictions_stays_at_the_first_quantizations(seed, monkeypatch):
    first, after = _drift(_keys(4000, seed))
    assert after <= 1.05 * first, (first, after)  # the acceptance bound: kept codes are exact
    # control: the old re-eviction (token by token: survivors regrouped, dequantized and quantized again)
    # makes the same check fail
    monkeypatch.setattr(Evictor, "_has_groups", lambda self, kv: False)
    first_old, after_old = _drift(_keys(4000, seed))
    assert first_old == first and after_old > 1.05 * first_old, (first_old, after_old)


@pytest.mark.slow
def test_k_error_on_real_keys_stays_at_the_first_quantizations():
    """The same on SmolLM2's post-RoPE K of real text (layer 10, a DynamicCache prefill)."""
    from transformers import DynamicCache

    from moend_fx.calibration.data import text_token_sequences
    from moend_fx.models import load_model

    model, tok = load_model("smollm2-135m")
    ids, _ = text_token_sequences(tok, 1, 3000, split="heldout")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    keys = cache.layers[10].keys.float()
    first, after = _drift(keys)
    assert after <= 1.05 * first, (first, after)
