"""No drift: decode-time re-evictions of a layer with quantized K drop whole packed groups, so every surviving K code
keeps its group's scale and zero and the K error stays that of the first quantization (the old way, dequantize
the survivors and quantize them again, grows it round after round: the control below shows the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from moend_fx.cache.layer import EvictionPolicy, MoENDLayer
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


def _drift(keys: torch.Tensor, rounds: int = 8, reevict: str = "groups") -> tuple[float, float]:
    """(K error after the prompt's quantization, after ``rounds`` decode-time re-evictions) of a keep-0.25 K4/V4
    layer fed keys [1, H, S, D]: the first T = S // 2 as the prompt, the rest one decode step at a time."""
    _, h, s, d = keys.shape
    t = s // 2
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(keys.shape, generator=gen)
    layer = MoENDLayer(CFG, layer_idx=0, scorer=get_scorer("keynorm"),
                       policy=EvictionPolicy(evict_every=16, sink_tokens=4, recent_tokens=8, reevict=reevict))
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
def test_k_error_after_8_re_evictions_stays_at_the_first_quantizations(seed):
    first, after = _drift(_keys(4000, seed))
    assert after <= 1.05 * first, (first, after)  # the acceptance bound: kept codes are exact
    # control, and what reevict="tokens" costs: token by token, the survivors are regrouped, dequantized and
    # quantized again, and the same check fails
    first_old, after_old = _drift(_keys(4000, seed), reevict="tokens")
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


def test_token_re_eviction_drops_the_lowest_ranked_tokens_not_a_group():
    """reevict="tokens": a decode-time re-eviction keeps exactly the best-ranked tokens it needs (a token set no
    whole-group drop could leave), re-quantized; "groups" drops whole packed groups."""
    h, d, t = 2, 32, 200
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, h, t + 64, d, generator=gen), torch.randn(1, h, t + 64, d, generator=gen)
    held = {}
    for mode in ("groups", "tokens"):
        layer = MoENDLayer(CFG, layer_idx=0, group_size=8, scorer=get_scorer("keynorm"),
                           policy=EvictionPolicy(evict_every=16, sink_tokens=2, recent_tokens=4, reevict=mode))
        layer.update(keys[:, :, :t], values[:, :, :t])
        layer.finish_prefill(torch.randn(1, h, t, d, generator=gen), None)
        step = t
        while layer.evictions < 2:
            layer.update(keys[:, :, step:step + 1], values[:, :, step:step + 1])
            layer.attend(torch.randn(1, h, 1, d, generator=gen), None)
            step += 1
        layer.settle()
        held[mode] = layer.packed.positions.long()
        assert layer.held <= t // 4 + 16  # keep_count(seen, 0.25) plus at most evict_every - 1 new tokens
    # keynorm keeps the smallest |k|. Among the prompt's tokens (its sinks and recent window aside), token mode
    # holds the smallest norms: every kept one below every dropped one, up to the 4-bit K error the re-evictions
    # rank by (they score dequantized keys: ~0.1 of a norm of ~5 here)
    norms = keys[0, 0].norm(dim=-1)

    def gap(pos: torch.Tensor) -> float:  # largest kept norm minus smallest dropped norm (<= 0: cleanly split)
        kept = pos[(pos >= 2) & (pos < t - 4)]
        dropped = torch.tensor([p for p in range(2, t - 4) if p not in set(kept.tolist())])
        return float(norms[kept].max() - norms[dropped].min())

    assert gap(held["tokens"][0, 0]) <= 0.1
    assert gap(held["groups"][0, 0]) > 0.1  # control: whole groups keep some large norms beside a small one
