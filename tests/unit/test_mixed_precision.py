"""memfit.MixedPrecision as a policy: validation, which dtype each module computes in, buffers."""

import dataclasses

import pytest
import torch
from torch import nn

import memfit
from memfit._shard._mixed import _NORMS as NORM_LAYERS


def test_defaults():
    mp = memfit.MixedPrecision()
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype, mp.keep_norms_fp32) == (torch.bfloat16, None, None, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = torch.float16


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"param_dtype must be a floating torch\.dtype"):
        memfit.MixedPrecision(param_dtype=torch.int8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"param_dtype": "bf16"}, r"param_dtype must be a floating torch\.dtype, got 'bf16'"),
        ({"reduce_dtype": torch.int32}, r"reduce_dtype must be a floating torch\.dtype, got torch\.int32"),
        ({"buffer_dtype": torch.bool}, r"buffer_dtype must be a floating torch\.dtype, got torch\.bool"),
        ({"reduce_dtype": torch.float32, "buffer_dtype": torch.float16}, None),  # valid
    ],
)
def test_validation_names_the_field(kwargs, message):
    if message is None:
        memfit.MixedPrecision(**kwargs)
        return
    with pytest.raises(ValueError, match=message):
        memfit.MixedPrecision(**kwargs)


def test_norm_layers_compute_in_fp32_unless_told_otherwise():
    norms = [nn.LayerNorm(4), nn.BatchNorm1d(4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4)]
    assert all(isinstance(m, NORM_LAYERS) for m in norms)
    mp = memfit.MixedPrecision(param_dtype=torch.float16)
    assert [mp.compute_dtype(m) for m in norms] == [torch.float32] * len(norms)
    assert mp.compute_dtype(nn.Linear(4, 4)) == torch.float16
    assert mp.compute_dtype(nn.Embedding(3, 4)) == torch.float16
    low = memfit.MixedPrecision(param_dtype=torch.float16, keep_norms_fp32=False)
    assert [low.compute_dtype(m) for m in norms] == [torch.float16] * len(norms)


def test_prepare_casts_buffers_outside_norms_and_casts_norm_io():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.ones(3))
            self.register_buffer("ids", torch.arange(3))  # not floating: left alone

    other, bn = WithBuffer(), nn.BatchNorm1d(4)
    memfit.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16).prepare([other, bn])
    assert other.table.dtype == torch.float16  # buffer_dtype
    assert other.ids.dtype == torch.int64
    assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32  # norms keep fp32 statistics
    out = bn(torch.randn(2, 4, dtype=torch.bfloat16))  # input cast to fp32, output back to bf16
    assert out.dtype == torch.bfloat16

    plain = WithBuffer()
    memfit.MixedPrecision(param_dtype=torch.bfloat16).prepare([plain])
    assert plain.table.dtype == torch.bfloat16  # buffer_dtype defaults to param_dtype
