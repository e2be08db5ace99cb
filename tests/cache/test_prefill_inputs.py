"""check_prefill_tensors: what load_prefill accepts, and the errors that name the problem."""

import pytest
import torch

from moend_fx.cache.prefill_inputs import check_prefill_tensors
from moend_fx.common.errors import MoendError

K = torch.randn(2, 3, 10, 16)


def _check(keys=K, values=K, queries=None, needs=False):
    check_prefill_tensors("layer 0", keys, values, queries, needs_queries=needs, scorer="snapkv", config="k0.5")


def test_accepts_matching_tensors():
    _check()
    _check(queries=torch.randn(2, 9, 4, 16), needs=True)


@pytest.mark.parametrize("kw,words", [
    (dict(keys=torch.randn(3, 10, 16)), "keys must be a 4-D tensor"),
    (dict(values=torch.randn(2, 3, 9, 16)), "same shape"),
    (dict(keys=K[:, :, :0], values=K[:, :, :0]), "hold no tokens"),
    (dict(needs=True), "needs the prompt's last queries"),
    (dict(queries=torch.randn(2, 8, 4, 16)), "H a multiple of Hkv=3"),
    (dict(queries=torch.randn(2, 9, 11, 16)), "1 <= W <= T=10"),
    (dict(queries="q"), "queries must be a 4-D tensor"),
])
def test_errors_name_the_problem(kw, words):
    with pytest.raises(MoendError, match=words):
        _check(**kw)
