"""The storage type rules: raw K/V in 16 bits (the model's own 16-bit type, else fp16), positions in the narrowest
integer type that holds the context."""

import pytest
import torch

from moend_fx.common.dtypes import STORAGE_DTYPE, as_dtype, position_dtype, storage_dtype
from moend_fx.common.errors import MoendError


@pytest.mark.parametrize("model, stored", [
    (torch.float32, torch.float16),  # fp16, not bf16: 10 mantissa bits keep a lossless plan closest to fp32
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),  # as is: bf16 values could overflow fp16
    (torch.float64, torch.float16),
    ("float32", torch.float16),  # a fingerprint's spelling
    ("torch.bfloat16", torch.bfloat16),
])
def test_storage_dtype(model, stored):
    assert storage_dtype(model) == stored and stored.itemsize == 2
    assert STORAGE_DTYPE == torch.float16


@pytest.mark.parametrize("bad", ["int8", "nope", torch.int32])
def test_storage_dtype_of_a_non_float_type_is_an_error(bad):
    with pytest.raises(MoendError, match="floating-point"):
        storage_dtype(bad)
    with pytest.raises(MoendError):
        as_dtype(bad)


@pytest.mark.parametrize("slots, dtype", [(0, torch.int16), (2048, torch.int16), (32767, torch.int16),
                                          (32768, torch.int16), (32769, torch.int32), (2**31, torch.int32)])
def test_position_dtype_boundary(slots, dtype):
    """slots 0..slots-1: int16 holds a context of up to 32768 tokens (largest position 32767)."""
    assert position_dtype(slots) == dtype
    if slots:
        assert torch.tensor(slots - 1).to(dtype).item() == slots - 1  # the largest position survives the cast


def test_position_dtype_past_int32_is_an_error():
    with pytest.raises(MoendError, match="slots"):
        position_dtype(2**31 + 1)
