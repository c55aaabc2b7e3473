"""The planner's time model on hand-built costs: prices, profiles, determinism."""

import dataclasses

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


def test_views_move_no_bytes_and_prim_ops_are_not_priced():
    from memfit.testing import CostRecorder

    x = torch.ones(64, 64)
    with CostRecorder() as rec:
        x.t().detach()
        torch.ops.prim.device.default(x)  # metadata, answered without a kernel: never priced
        y = x * 2
    ops = {c.op: c for _, c in rec.ops}
    assert ops["aten.t"].bytes == ops["aten.detach"].bytes == 0
    assert ops["aten.mul"].bytes == 2 * x.nbytes and ops["aten.mul"].elements == y.numel()
    assert not any(c.op.startswith("prim.") for _, c in rec.ops)


def test_bandwidth_curve_and_math_rates():
    curve = ((1e3, 1e9), (1e6, 4e9), (1e9, 1e9))  # cache-resident ops faster than memory
    p = memfit.DeviceProfile("c", {"float32": 1e9}, 1e9, 1e8, 0.0, bandwidth_curve=curve, math_rates={"aten.exp": 1e6})
    assert p.bandwidth(10) == 1e9 and p.bandwidth(1e6) == 4e9 and p.bandwidth(1e12) == 1e9
    assert p.bandwidth(10**4.5) == pytest.approx(2.5e9)  # halfway on log bytes
    exp = OpCost("aten.exp", flops=0, bytes=8_000, dtype=torch.float32, elements=1_000)
    add = OpCost("aten.add", flops=0, bytes=8_000, dtype=torch.float32, elements=1_000)
    assert p.op_time(exp) == pytest.approx(1e-3)  # 1000 elements at 1M/s: arithmetic bound
    assert p.op_time(add) == pytest.approx(8_000 / p.bandwidth(8_000))
    fresh = memfit.DeviceProfile("f", {"float32": 1e9}, 1e9, 1e8, 0.0, fresh_threshold=1e6, fresh_bandwidth=1e8)
    big = OpCost("aten.fill_", 0, 2_000_000, torch.float32, elements=500_000, largest_output=2_000_000)
    small = dataclasses.replace(big, largest_output=999_999)
    assert fresh.op_time(big) == pytest.approx(2e-3 + 2e-2)  # its bytes, then its fresh pages at 100 MB/s
    assert fresh.op_time(small) == pytest.approx(2e-3)  # below the threshold: reused memory
    mm = memfit.DeviceProfile("m", {"float32": 1e9}, 1e9, 1e8, 0.0, matmul_latency=1e-5)
    assert mm.op_time(OpCost("aten.mm", 1_000_000, 0, torch.float32)) == pytest.approx(1e-3 + 1e-5)


def test_a_calibration_round_trips_through_its_cache(tmp_path, monkeypatch):
    import json

    from memfit.testing import calibrate

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    measured = calibrate("cpu")
    assert measured.bandwidth_curve and measured.flops["float32"] > 0 and measured.op_overhead > 0
    assert device_profile("calibrated") == measured  # tuples and dicts back from JSON
    assert json.loads((tmp_path / "device-cpu.json").read_text())["name"] == "calibrated-cpu"
