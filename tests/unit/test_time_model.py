"""The planner's time model on hand-built costs: prices, profiles, determinism."""

import dataclasses
import functools

import pytest
import torch

import memfit
from memfit._plan import _calibrate
from memfit._plan._calibrate import device_profile
from memfit._plan._time import PROFILES, OpCost

FLAT = memfit.DeviceProfile("flat", {"float32": 1e9}, 1e9, 1e8, 1e-6)
# pytest.approx (rel 1e-6) throughout: float64 prices, the model's sum and division in another
# order than the expected expression's; the arithmetic is otherwise the same.


def test_an_op_costs_its_roofline_plus_dispatch():
    mm = OpCost("aten.mm", flops=2_000_000, bytes=1_000, dtype=torch.float32)  # compute bound
    add = OpCost("aten.add", flops=0, bytes=4_000_000, dtype=torch.float32)  # memory bound
    assert FLAT.op_time(mm) == pytest.approx(2e-3 + 1e-6)  # 2 MFLOP at 1 GFLOP/s
    assert FLAT.op_time(add) == pytest.approx(4e-3 + 1e-6)  # 4 MB at 1 GB/s
    assert FLAT.ops_time([mm, add]) == pytest.approx(6e-3 + 2e-6)


def test_rates_per_dtype_and_named_profiles():
    from memfit._plan._time import _H100_FIT

    h100 = device_profile("h100")  # achieved rates, not the data sheet's 989 and 67 TFLOP/s
    assert h100.rate(torch.bfloat16) == pytest.approx(_H100_FIT["bfloat16"])  # peak x efficiency: rounding
    assert h100.rate(torch.float32) == pytest.approx(_H100_FIT["float32"])
    a100 = PROFILES["a100"]  # the H100's efficiency on the A100's peaks
    assert a100.rate(torch.bfloat16) == pytest.approx(312e12 * _H100_FIT["bfloat16"] / 989e12)
    assert FLAT.rate(torch.bfloat16) == 1e9  # no bf16 rate: float32's
    assert set(PROFILES) >= {"h100", "h200", "a100", "cpu"}
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu'.*'calibrated'"):
        device_profile("tpu")
    with pytest.raises(ValueError, match="rates must be positive"):
        memfit.DeviceProfile("bad", {"float32": 0.0}, 1.0, 1.0, 0.0)


def test_views_move_no_bytes_and_prim_ops_are_not_priced():
    from memfit._plan._time import CostRecorder

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

    from memfit._plan._calibrate import calibrate

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    # The round trip is under test, not the rates: operand pools of 4 MiB, not 64 (see [Note:
    # Calibrating on cold data]), cut the work about 16x; the rates come out warm, still > 0.
    monkeypatch.setattr(_calibrate, "_cold", functools.partial(_calibrate._cold, pool_bytes=4 * 2**20))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a loaded 2-core machine wait on each other: 10x slower
    try:
        measured = calibrate("cpu", cpu_time=True)
    finally:
        torch.set_num_threads(threads)
    assert measured.bandwidth_curve and measured.flops["float32"] > 0 and measured.op_overhead > 0
    assert min(measured.checkpoint_block, measured.checkpoint_op) >= 0
    assert set(measured.score_rates) <= {  # the CPU's attention kernels, where slower than their flops
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert device_profile("calibrated") == measured  # tuples and dicts back from JSON
    assert json.loads((tmp_path / "device-cpu.json").read_text())["name"] == "calibrated-cpu"
    assert measured.calibrated_ranks == 1  # one process: a plan for more ranks warns (test_planner)


def test_attention_ops_price_their_scores():
    from memfit._plan._time import CostRecorder

    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    k = torch.randn(2, 3, 24, 8)
    with CostRecorder() as rec:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        out.sum().backward()
    attention = [c for c in rec.costs if c.scores]
    assert attention and all(c.scores == 2 * 3 * 16 * 24 for c in attention)  # b*h*sq*sk, backward too
    assert all(c.flops for c in attention) and not any(c.scores for c in rec.costs if "scaled_dot" not in c.op)
    rates = {c.op: 1e6 for c in attention}
    p = memfit.DeviceProfile("s", {"float32": 1e9}, 1e12, 1e8, 1e-6, score_rates=rates)
    for c in attention:  # flops at the matmul rate, then each score at 1M/s: bytes are far below
        assert p.op_time(c) == pytest.approx(c.flops / 1e9 + c.scores / 1e6 + 1e-6)
        assert FLAT.op_time(c) == pytest.approx(max(c.flops / 1e9, c.bytes / 1e9) + 1e-6)  # no rate: flops


def test_checkpoint_time_per_block_and_added_op():
    p = memfit.DeviceProfile("c", {"float32": 1e9}, 1e9, 1e8, 1e-6, checkpoint_block=1e-4, checkpoint_op=2e-6)
    assert p.checkpoint_time(0) == pytest.approx(1e-4) and p.checkpoint_time(50) == pytest.approx(2e-4)
    assert FLAT.checkpoint_time(50) == 0.0
    cpu = PROFILES["cpu"]  # fixed rates: no checkpoint cost beyond op_overhead per op
    assert cpu.checkpoint_time(50) == 0.0 and not cpu.score_rates and not cpu.math_rates
    for name in ("h100", "h200", "a100"):  # the fitted host cost of a checkpoint frame: see _H100_FIT
        named = PROFILES[name]
        assert named.checkpoint_time(50) == named.checkpoint_block >= 0 and not named.score_rates


def test_the_matmul_latency_comes_from_the_small_products():
    """Noise of a few percent on the largest products moves a least-squares intercept by far
    more than the latency itself; the small products' excess over their flops hardly moves."""
    from memfit._plan._calibrate import _fit, _matmul_fit

    rate, latency = 80e9, 50e-6
    work = [4e6, 8e6, 16e6, 34e6] * 2 + [1e9, 2e9, 1e9, 2e9]  # 8 small (the smaller width), then large
    seconds = [x / rate + latency for x in work]
    assert _matmul_fit(work, seconds, small=8) == pytest.approx((rate, latency))
    for e in (0.03, -0.03):  # the 1 GFLOP products 3% slow and the 2 GFLOP ones 3% fast, or the reverse
        noisy = seconds[:8] + [t * (1 + e if x < 1.5e9 else 1 - e) for x, t in zip(work[8:], seconds[8:])]
        fitted_rate, fitted = _matmul_fit(work, noisy, small=8)
        assert fitted_rate == pytest.approx(rate, rel=0.03)  # off by 2.2%: the large products set it
        assert fitted == pytest.approx(latency, rel=0.1)  # off by 6.5%: the rate's error on 4-34 MFLOP
        assert abs(_fit(work, noisy)[1] - latency) > 10 * abs(fitted - latency)  # the intercept's error


def test_an_accelerators_matmul_latency_is_a_tiny_products_time():
    """On an accelerator the calibration's widths (1024 and 4096) take hundreds of us; the
    latency is a 64 x 64 product's time beyond its flops (run here on the CPU: the arithmetic)."""
    from memfit._plan._calibrate import _tiny_matmul_latency

    ran = []

    def timed(fn, repeats=5):
        fn()
        ran.append(fn)
        return 30e-6

    cpu = torch.device("cpu")
    assert _tiny_matmul_latency(cpu, torch.float32, 2 * 64**3 / 10e-6, timed) == pytest.approx(20e-6)
    assert _tiny_matmul_latency(cpu, torch.float32, 2 * 64**3 / 40e-6, timed) == 0.0  # never below 0
    assert len(ran) == 2
