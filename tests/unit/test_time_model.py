"""The planner's time model on hand-built costs: prices, profiles, determinism."""

import pytest
import torch

import memfit
from memfit.testing import PROFILES, OpCost, device_profile

FLAT = memfit.DeviceProfile("flat", {"float32": 1e9}, 1e9, 1e8, 1e-6)


def test_an_op_costs_its_roofline_plus_dispatch():
    mm = OpCost("aten.mm", flops=2_000_000, bytes=1_000, dtype=torch.float32)  # compute bound
    add = OpCost("aten.add", flops=0, bytes=4_000_000, dtype=torch.float32)  # memory bound
    assert FLAT.op_time(mm) == pytest.approx(2e-3 + 1e-6)  # 2 MFLOP at 1 GFLOP/s
    assert FLAT.op_time(add) == pytest.approx(4e-3 + 1e-6)  # 4 MB at 1 GB/s
    assert FLAT.ops_time([mm, add]) == pytest.approx(6e-3 + 2e-6)


def test_rates_per_dtype_and_named_profiles():
    h100 = device_profile("h100")
    assert h100.rate(torch.bfloat16) == 989e12 and h100.rate(torch.float32) == 67e12
    assert FLAT.rate(torch.bfloat16) == 1e9  # no bf16 rate: float32's
    assert set(PROFILES) >= {"h100", "h200", "a100", "cpu"}
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu'.*'calibrated'"):
        device_profile("tpu")
    with pytest.raises(ValueError, match="rates must be positive"):
        memfit.DeviceProfile("bad", {"float32": 0.0}, 1.0, 1.0, 0.0)
