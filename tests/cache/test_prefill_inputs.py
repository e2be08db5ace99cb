"""check_prefill_tensors: what load_prefill accepts (and the sizes it reads off), and the errors that name the
problem."""

import pytest
import torch

from moend_fx.cache.prefill_inputs import PrefillShape, check_prefill_tensors
from moend_fx.common.errors import MoendError

K = torch.randn(2, 3, 10, 16)


def _check(keys=K, values=K, queries=None, needs=False):
    return check_prefill_tensors("layer 0", keys, values, queries, needs_queries=needs, scorer="snapkv",
                                 config="k0.5")


@pytest.mark.parametrize("queries,needs,window", [
    (None, False, 0),  # a scorer that reads no queries
    (torch.randn(2, 9, 4, 16), True, 4),  # GQA: 3 query heads per KV head
    (torch.randn(2, 3, 10, 16), True, 10),  # MHA, a window as long as the prompt (W = T)
    (torch.randn(2, 6, 1, 16), False, 1),  # queries given although not needed: still checked, then used
])
def test_accepts_matching_tensors_and_reads_their_sizes(queries, needs, window):
    shape = _check(queries=queries, needs=needs)
    assert shape == PrefillShape(batch=2, kv_heads=3, tokens=10, head_dim=16, queries=window)


@pytest.mark.parametrize("kw,words", [
    (dict(keys=torch.randn(3, 10, 16)), "keys must be a 4-D tensor"),
    (dict(values=torch.randn(2, 3, 9, 16)), "same shape"),
    (dict(keys=K[:, :, :0], values=K[:, :, :0]), "hold no tokens"),
    (dict(needs=True), "needs the prompt's last queries"),
    (dict(queries=torch.randn(2, 8, 4, 16)), "H a multiple of Hkv=3"),
    (dict(queries=torch.randn(2, 9, 11, 16)), "1 <= W <= T=10"),
    (dict(queries=torch.randn(1, 9, 4, 16)), r"must be \[B=2, H, W, D=16\]"),
    (dict(queries=torch.randn(2, 9, 4, 8)), r"must be \[B=2, H, W, D=16\]"),
    (dict(queries="q"), "queries must be a 4-D tensor"),
])
def test_errors_name_the_problem(kw, words):
    with pytest.raises(MoendError, match=words):
        _check(**kw)
