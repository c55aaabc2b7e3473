"""Issue 23 point 14: every rank's slot in a unit's all-gather and reduce-scatter buffers is a
multiple of 16 bytes, so each slot starts where the buffer's (aligned) start does: the
vectorised copy and NCCL paths need it. Checked on the meta test device (simulated ranks)
for odd parameter sizes and every wire dtype; the slot's tail (unit index, flags, check
sums) still sits where the checks read it.

Only a GPU shows the speed of aligned slots (NCCL and the copy kernels' 16-byte paths).
"""

import pytest
import torch
from torch import nn

import memfit
from memfit.testing import meta_accelerator, sharded_units

META = torch.device("meta")


class Odd(nn.Module):
    """Parameters of odd sizes, a LayerNorm (kept fp32 under mixed precision) and a bias-free layer."""

    def __init__(self, d_in: int):
        super().__init__()
        self.a, self.b = nn.Linear(d_in, 5), nn.Linear(5, 3, bias=False)
        self.norm = nn.LayerNorm(3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.norm(self.b(self.a(x))) * self.scale


MIXED = [
    None,
    memfit.MixedPrecision(torch.bfloat16),  # a byte wire (bf16 beside fp32), reduced in fp32
    memfit.MixedPrecision(torch.bfloat16, keep_norms_fp32=False),  # bf16 wire, bf16 sums
    memfit.MixedPrecision(torch.float16, reduce_dtype=torch.float32),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mp", MIXED, ids=["fp32", "bf16+fp32", "bf16", "fp16/fp32"])
def test_every_slot_is_a_multiple_of_16_bytes(world, mp):
    with meta_accelerator(world):
        model = nn.Sequential(Odd(7), Odd(3))
        memfit.shard(model[0], mixed_precision=mp)
        memfit.shard(model, mixed_precision=mp)
        memfit.materialize(model)
        model(torch.randn(2, 7, device=META)).sum().backward()
        units = sharded_units(model)
        for u in units:
            gather = u._gather_layout()
            assert gather.slot * gather.wire.itemsize % 16 == 0, (u.name, gather.slot, gather.wire)
            assert gather.slot == sum(gather.sizes)  # what the copy-out splits: the whole slot
            reduces = list(u._reduce_plans.values())
            assert reduces, u.name
            for r in reduces:
                assert r.slot * r.dtype.itemsize % 16 == 0, (u.name, r.slot, r.dtype)
                assert r.tail((True,) * len(r.params)).shape == (world, r.slot - r.flags)
                assert r.checked == len(r.params) + 2
