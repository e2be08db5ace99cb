"""examples/needle_layers.py: finding the needle's tokens and counting the KV heads that hold them (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.plan.config import LayerConfig
from tests.examples.helpers import load_example


@pytest.fixture(scope="module")
def needle():
    return load_example("needle_layers")


def test_find_span_is_the_first_occurrence(needle):
    assert needle.find_span([5, 1, 2, 3, 1, 2, 3], [1, 2, 3]) == 1
    assert needle.find_span([1, 2], [1, 2]) == 0
    with pytest.raises(MoendError, match="do not occur in the prompt"):
        needle.find_span([1, 2, 4], [2, 3])


def test_heads_holding_counts_each_token_over_heads(needle):
    g = torch.Generator().manual_seed(0)
    # 3 KV heads holding random ascending positions, then the needle (positions 40-42) planted per head
    held = torch.sort(torch.randint(0, 40, (1, 3, 8), generator=g), dim=-1).values
    held[0, 0, -3:] = torch.tensor([40, 41, 42])  # head 0: the whole needle
    held[0, 1, -1] = 41  # head 1: its middle token only
    assert needle.heads_holding(held.to(torch.int16), 40, 3) == [1, 2, 1]
    assert needle.heads_holding(held, 50, 2) == [0, 0]  # past every held position
    assert needle.heads_holding(None, 40, 3) is None  # a layer that evicts nothing


def test_layer_rows_name_each_layers_config_and_counts(needle):
    held = torch.tensor([[[3, 7, 8], [7, 8, 9]]])
    cache = SimpleNamespace(layers=[SimpleNamespace(packed=SimpleNamespace(positions=held)),
                                    SimpleNamespace(packed=SimpleNamespace(positions=None))])
    plan = SimpleNamespace(layers=[LayerConfig(0.25, 8, 4), LayerConfig(1.0, 16, 16)])
    assert needle.layer_rows(cache, plan, 7, 3) == ["0:keep0.25_k8_v4:221", "1:keep1_k16_v16:-"]


def test_a_bad_index_or_variant_is_a_clear_error_before_any_model_loads(needle):
    with pytest.raises(MoendError, match=r"--index 30 is not allowed; allowed: 0 <= index < --n \(30\)"):
        needle.main(["--index", "30"])
    with pytest.raises(MoendError, match="variant 'nope' is unknown"):
        needle.main(["--variants", "nope"])
    with pytest.raises(MoendError, match="'full' holds every token"):
        needle.main(["--variants", "base,full"])
