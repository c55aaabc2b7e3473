"""`memfit calibrate` on an accelerator: the overlapped model's rates measured on the device
(see [Note: Host and device time] and [Note: Calibrating an accelerator]).

Nothing here has run on a GPU in this repository's tests (the CI and the development hosts have
none): the CUDA path is written for the device and its output's structure is tested on the CPU
(tests/unit/test_time_model.py calls :func:`accelerator_figures` with a CPU stand-in for each
timing). The GPU validation (benchmarks/gpu) runs :func:`calibrate_device` and commits the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from memfit._plan._calibrate import calibrate
from memfit._plan._time import MEASURED, RESULTS, DeviceProfile, default_profile

# [Note: Calibrating an accelerator]
# On CUDA, `memfit calibrate` measures, in about a minute (each timing the fastest of a few
# after a warm-up, device time from CUDA events, the whole bounded by DEADLINE seconds):
#   flops[dtype]      fp32, bf16 and fp16 matmuls of several shapes (a Linear layer's three
#                     products at widths 1024 and 4096: _calibrate._matmul_rate), the rate and
#                     the latency fitted by least squares: efficiency by shape is that line;
#   attention_flops   F.scaled_dot_product_attention forward and backward in bf16 and fp16 at
#                     head size 128 (the flash kernel CUDA picks), seq 1024 to 4096, causal or
#                     not: FLOP/s over torch's flop count, halved for causal (the model's rule);
#   memory_bandwidth  a 1 GiB device-to-device copy (read and written);
#   kernel_floor      the device seconds of a tiny kernel, timed behind torch.cuda._sleep so the
#                     host has queued them all before the device starts (device time only);
#   host_op           the host seconds to queue one tiny op (the device asleep: host time only);
#   profiled_launch   last (it leaves CUPTI attached for the rest of the process): the same host
#                     time after one torch.profiler run with CUDA activities, less host_op, per
#                     launch (what a process pays once it has profiled: [Note: Host and device time]);
#   checkpoint_*      what checkpointing a tiny model's blocks adds (_calibrate._op_overhead);
#   offload_bandwidth a pinned device-to-host copy.
# selective_op and the sharding hooks are not timed here: they stay the named profile's (fitted).
DEADLINE = 120.0  # seconds: the bound on a calibration


def _events_seconds(fn: Callable[[], None], repeats: int = 3, asleep: bool = False) -> float:
    """Device seconds of ``fn`` between two CUDA events, the fastest of ``repeats`` after a
    warm-up; ``asleep``: the device first sleeps ~20 ms so that the host has queued all of
    ``fn`` before the first event (device time only)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if asleep:
            torch.cuda._sleep(40_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _host_seconds(fn: Callable[[], None], repeats: int = 3) -> float:
    """Host seconds to queue ``fn`` while the device sleeps (the queue never waits on it)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(40_000_000)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best


def _attention(device: torch.device, dtype: torch.dtype, seconds, scale: int) -> float:
    """FLOP/s of fused attention forward and backward (see [Note: Calibrating an accelerator])."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    f = torch.nn.functional.scaled_dot_product_attention
    flops, took = 0.0, 0.0
    for seq, causal in ((1024 // scale, False), (4096 // scale, True)):
        shape = (max(1, 8192 // scale // seq), 16, seq, 128)
        q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(shape, device=device, dtype=dtype)
        took += seconds(lambda q=q, g=g, causal=causal: f(q, q, q, is_causal=causal).backward(g))
        work = sdpa_flop_count(q.shape, q.shape, q.shape) + sdpa_backward_flop_count(g.shape, q.shape, q.shape, q.shape)
        flops += work * (0.5 if causal else 1.0)
    return flops / took


def _cuda_profiler() -> contextlib.AbstractContextManager:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def accelerator_figures(
    device: torch.device, seconds, host_seconds, scale: int = 1, profiler: Callable[[], object] | None = None
) -> dict:
    """The figures of [Note: Calibrating an accelerator] beyond calibrate()'s, with ``seconds``
    (device time of a callable; its ``asleep`` keyword: queued behind a sleep) and
    ``host_seconds`` (host time to queue a callable); ``scale``: every size divided by it (the
    CPU test of its structure); ``profiler``: a context manager factory run once before
    profiled_launch is timed (torch.profiler with CUDA activities on the device; None: none)."""
    x = torch.ones(256, device=device)
    n = 200

    def tiny() -> None:
        for _ in range(n):
            x.add_(1.0)

    big = torch.empty(2**28 // scale, device=device)  # 1 GiB of fp32
    out = torch.empty_like(big)
    copy = seconds(lambda: out.copy_(big))
    halves = (torch.bfloat16, torch.float16)
    attention = {str(d).removeprefix("torch."): _attention(device, d, seconds, scale) for d in halves}
    figures = {
        "attention_flops": attention,
        "memory_bandwidth": 2 * big.nbytes / copy,
        "kernel_floor": seconds(tiny, asleep=True) / n,
        "host_op": host_seconds(tiny) / n,
    }
    with (profiler or contextlib.nullcontext)():  # type: ignore[attr-defined]
        tiny()
    figures["profiled_launch"] = max(0.0, host_seconds(tiny) / n - figures["host_op"])  # last: CUPTI stays
    return figures


def calibrate_device(device: str | torch.device = "cuda", results: Path | None = None) -> tuple[DeviceProfile, Path]:
    """Calibrate the current accelerator (calibrate() and :func:`accelerator_figures`) and write
    the measured figures to ``results/profile_<name>.json``, ``<name>`` the named profile of the
    device (h100, h200, a100), which then uses them ([Note: Host and device time]). Runs on CUDA
    only; not run in this repository's CPU tests (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"memfit calibrate_device: {device} is not a CUDA device; use memfit.calibrate on a CPU")
    t0 = time.perf_counter()
    base = calibrate(device, save=False)
    fp16, _ = _fp16_rate(device)
    extra = accelerator_figures(device, _events_seconds, _host_seconds, profiler=_cuda_profiler)
    profile = dataclasses.replace(base, flops=dict(base.flops) | {"float16": fp16}, **extra)
    took = time.perf_counter() - t0
    if took > DEADLINE:  # the figures are still the device's: kept, and the overrun said
        warnings.warn(f"memfit calibrate_device: took {took:.0f} s, over its {DEADLINE:.0f} s", stacklevel=2)
    named = default_profile(device).name
    return profile, write_profile(profile, named, results)


def _fp16_rate(device: torch.device) -> tuple[float, float]:
    from memfit._plan._calibrate import _best_seconds, _matmul_rate

    def timed(fn, repeats=5):
        def run():
            fn()
            torch.cuda.synchronize()

        return _best_seconds(run, repeats)

    return _matmul_rate(device, torch.float16, timed)


def write_profile(profile: DeviceProfile, name: str, results: Path | None = None) -> Path:
    """Write ``profile``'s measured figures (MEASURED, and where they come from) as the named
    profile ``name``'s calibration; returns the file."""
    path = (results or RESULTS) / f"profile_{name}.json"
    record = {k: getattr(profile, k) for k in MEASURED} | {"source": profile.source, "device": name}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


__all__ = ["DEADLINE", "accelerator_figures", "calibrate_device", "write_profile"]
