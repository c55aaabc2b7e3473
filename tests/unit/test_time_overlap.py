"""The overlapped time model of an accelerator ([Note: Host and device time]): a region's time is
the larger of its host and device time, memfit's hooks are host time, every named figure names
its source, and a calibration's output has the structure a named profile reads back."""

import contextlib
import dataclasses
import json

import pytest
import torch

import memfit
from memfit._plan._time import MEASURED, PROFILES, CostRecorder, OpCost, named_profile

GPU = memfit.DeviceProfile(
    "gpu", {"float32": 1e12, "bfloat16": 4e12}, 1e11, 1e10, 5e-6, host_op=1e-5, kernel_floor=2e-6,
    attention_flops={"bfloat16": 2e12}, selective_op=3e-6, shard_unit=1e-4, shard_param=1e-5,
    checkpoint_block=2e-4,
)  # fmt: skip
MM = OpCost("aten.mm", flops=10**9, bytes=10**6, dtype=torch.float32)  # 1 ms at 1 TFLOP/s
ADD = OpCost("aten.add", flops=0, bytes=10**6, dtype=torch.float32)  # 10 us at 100 GB/s
VIEW = OpCost("aten.t", flops=0, bytes=0, dtype=torch.float32)


def test_a_region_costs_the_larger_of_host_and_device():
    device = 1e-3 + 2e-6 + 1e-5 + 2e-6  # the mm, the add, each with the kernel floor; the view none
    assert GPU.split([MM, ADD, VIEW]) == pytest.approx((3e-5, device))  # host: every op dispatched
    assert GPU.ops_time([MM, ADD, VIEW]) == pytest.approx(device)  # device bound
    adds = [ADD] * 100  # 100 x 10 us of host, 100 x 12 us of device
    assert GPU.ops_time(adds) == pytest.approx(100 * 12e-6)
    assert GPU.ops_time(adds, host_extra=1e-3) == pytest.approx(100 * 1e-5 + 1e-3)  # hooks: host bound
    serial = dataclasses.replace(GPU, host_op=0.0)  # no host term: every op's work plus op_overhead
    assert not serial.overlapped and serial.ops_time([MM, ADD]) == pytest.approx(1e-3 + 1e-5 + 2 * 5e-6)


def test_hooks_are_counted_per_block_op_unit_and_parameter():
    keep = [ADD] * 10
    full = [ADD] * 14  # 4 ops recomputed
    host_full = 14 * 1e-5 + 2e-4  # the ops and checkpoint's frame
    assert GPU.decision_time("full", full, keep) == pytest.approx(host_full - 10 * 12e-6)
    selective = host_full + 14 * 3e-6  # and selective's dispatch on each of its ops
    assert GPU.decision_time("selective", full, keep) == pytest.approx(selective - 10 * 12e-6)
    assert GPU.decision_time("keep", full, keep) == 0.0
    assert GPU.shard_hooks(units=25, params=390) == pytest.approx(25 * 1e-4 + 390 * 1e-5)
    # offload's copies run beside the block's compute: only what they exceed it by
    assert GPU.offload_time(10**8, forward=1e-3) == pytest.approx(2e-2 - 3e-3)
    assert GPU.offload_time(10**6, forward=1e-3) == 0.0
    assert dataclasses.replace(GPU, host_op=0.0).offload_time(10**6, forward=1e-3) == pytest.approx(2e-4)


def test_a_profiled_process_pays_per_kernel_launch_and_a_plan_never_does():
    from memfit._plan._time import kernel_launches

    stream = [MM, ADD, VIEW, VIEW, ADD]  # three kernels: views launch none
    assert kernel_launches(stream) == 3
    profiled = dataclasses.replace(GPU, profiled_launch=4e-6)
    assert profiled.profiled_time(stream) == pytest.approx(3 * 4e-6)
    assert GPU.profiled_time(stream) == 0.0  # no figure: nothing
    # the profile's own prices (what a plan uses) leave it out
    assert profiled.split(stream) == GPU.split(stream) and profiled.ops_time(stream) == GPU.ops_time(stream)
    h100 = PROFILES["h100"]
    assert h100.profiled_launch > 0 and "benchmarks/gpu_time_rows.py" in h100.sources["profiled_launch"]


def test_causal_attention_is_recorded_and_priced_at_half():
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    with CostRecorder() as rec:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    attention = [c for c in rec.costs if c.scores]
    causal = [c.causal for c in attention]
    assert causal == [True, True, False, False]  # forward and backward of each call
    bf16 = [dataclasses.replace(c, dtype=torch.bfloat16, bytes=0) for c in attention]
    for c in bf16:  # the fused kernel's rate, halved where causal; its floor
        assert GPU.device_time(c) == pytest.approx(c.flops * (0.5 if c.causal else 1) / 2e12 + 2e-6)


def test_every_named_figure_names_its_source():
    for name in ("h100", "h200", "a100"):
        p = PROFILES[name]
        assert p.overlapped  # an accelerator: host and device side by side
        for field in dataclasses.fields(p):
            value = getattr(p, field.name)
            if field.name in ("name", "source", "sources", "ranks_per_node", "collective_overlap"):
                continue
            if isinstance(value, (int, float, dict)) and value and not isinstance(value, bool):
                assert p.sources.get(field.name), f"{name}.{field.name} = {value} names no source"
    assert PROFILES["cpu"].sources and not PROFILES["cpu"].overlapped


def test_a_calibration_writes_what_the_named_profile_reads(tmp_path):
    from memfit._plan._calibrate_device import accelerator_figures, write_profile

    calls = []

    def seconds(fn, asleep=False):  # a stand-in for CUDA events: the structure is under test
        fn()
        calls.append(asleep)
        return 1e-3

    hosts = [4e-4, 6e-4]  # host_op's timing, then profiled_launch's after the profiler ran

    timed: list = []

    def host_seconds(fn):
        fn()
        timed.append(fn)
        return hosts[len(timed) - 1]

    profiled = []

    @contextlib.contextmanager
    def profiler():  # a stand-in for torch.profiler: once, after every other timing (CUPTI stays)
        profiled.append((len(calls), len(timed)))
        yield

    figures = accelerator_figures(torch.device("cpu"), seconds, host_seconds, scale=64, profiler=profiler)
    assert set(figures) == {"attention_flops", "memory_bandwidth", "kernel_floor", "host_op", "profiled_launch"}
    assert profiled == [(len(calls), 1)] and figures["profiled_launch"] == pytest.approx(
        2e-4 / 200
    )  # after everything else
    assert set(figures["attention_flops"]) == {"bfloat16", "float16"} and min(figures["attention_flops"].values()) > 0
    assert figures["host_op"] == pytest.approx(4e-4 / 200) and figures["kernel_floor"] == pytest.approx(1e-3 / 200)
    assert calls.count(True) == 1  # the tiny kernels timed behind the device's sleep: device time only
    measured = dataclasses.replace(PROFILES["h100"], source="measured on a test", **figures)
    path = write_profile(measured, "h100", tmp_path)
    assert path.name == "profile_h100.json" and set(json.loads(path.read_text())) == {*MEASURED, "source", "device"}
    used = named_profile("h100", tmp_path)
    assert used.host_op == figures["host_op"] and used.attention_flops == figures["attention_flops"]
    assert "profile_h100.json" in used.sources["host_op"] and "profile_h100.json" in used.source
    assert used.selective_op == PROFILES["h100"].selective_op  # not measured: the fitted figure stays
    assert named_profile("a100", tmp_path) == PROFILES["a100"]  # no file: the named figures
