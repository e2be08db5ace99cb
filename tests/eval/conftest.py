"""Fixtures shared by the evaluation tests: a tiny random model and its table (a test module may define its own)."""

from __future__ import annotations

import pytest
import torch

from moend_fx.calibration.pipeline import calibrate
from moend_fx.models import tiny_model


@pytest.fixture(scope="module")
def model():
    # 3 layers so per-layer plans differ from uniform ones; GQA (4 query heads over 2 KV heads).
    return tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=1)


@pytest.fixture(scope="module")
def table(model):
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    return calibrate(model, token_ids=ids)
