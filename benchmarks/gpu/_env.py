"""What the parts share: the device, timing with device events, allocator peaks, the W=1
process group, and a goal's pass/fail record."""

from __future__ import annotations

import contextlib
import datetime
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 2**20
GIB = 2**30


def goal(name: str, value: float | None, target: str, passed: bool) -> dict:
    """One goal of the issue: what was measured, the target it is held to and whether it met it."""
    return {"name": name, "value": value, "target": target, "passed": bool(passed)}


@dataclass
class Env:
    """Where and how the parts run."""

    device: torch.device
    smoke: bool
    out: Path
    repo: Path
    bert_batch: int = 0  # part b's batch (0: its default)
    profiler_sessions: int = 0  # torch.profiler sessions this process ran (sharding.profile_step)
    started: float = field(default_factory=time.perf_counter)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        """Drop what the last measurement left: garbage, cached allocator blocks, peaks."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def autocast(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """bf16 autocast on this device (the CPU's in smoke mode); nothing for fp32."""
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def times(self, step: Callable[[], object], repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` calls: device events around each on CUDA (one host
        sync at the end), the host clock on the CPU."""
        if not self.cuda:
            out = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                out.append(time.perf_counter() - t0)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]

    def median_time(self, step: Callable[[], object], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            step()
        return statistics.median(self.times(step, repeats))

    def allocator_peaks(self, step: Callable[[], object]) -> dict[str, int | None]:
        """``max_memory_allocated`` / ``max_memory_reserved`` of one call of ``step`` (None on the CPU)."""
        if not self.cuda:
            step()
            return {"max_allocated": None, "max_reserved": None}
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return {
            "max_allocated": torch.cuda.max_memory_allocated(self.device),
            "max_reserved": torch.cuda.max_memory_reserved(self.device),
        }

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    @contextlib.contextmanager
    def process_group(self) -> Iterator[None]:
        """A world of one rank on 127.0.0.1: NCCL on CUDA, gloo on the CPU (kept if one exists)."""
        if dist.is_initialized():
            yield
            return
        from memfit.testing import free_port

        dist.init_process_group(
            "nccl" if self.cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def device_name(device: torch.device) -> str:
    """The short name results files carry: h100, h200, a100, ... from the GPU's name; cpu."""
    if device.type != "cuda":
        return "cpu"
    full = torch.cuda.get_device_name(device).lower()
    for short in ("h200", "h100", "gh200", "a100", "a10g", "l40s", "l4", "4090", "3090", "v100", "t4"):
        if short in full:
            return short
    return "".join(c if c.isalnum() else "_" for c in full.replace("nvidia", "").strip())


def errors_of(results: dict[str, dict[str, dict]]) -> dict[str, str]:
    """{"row / column": error} of a two-level table of results whose failed cells hold "error"."""
    return {f"{a} / {b}": r["error"] for a, rows in results.items() for b, r in rows.items() if "error" in r}


def profile_errors(results: dict[str, dict[str, dict]]) -> dict[str, str]:
    """{"row / column (profile)": error} of the rows whose second pass failed."""
    return {
        f"{a} / {b} (profile)": r["profile_error"]
        for a, rows in results.items()
        for b, r in rows.items()
        if "profile_error" in r
    }


def timed_after_profiler(results: dict[str, dict[str, dict]], sessions_at_start: int) -> dict:
    """The rows timed after a profiler session of their own part (should be none), the
    sessions earlier parts ran, and TEARDOWN_CUPTI (see [Note: Time before profiling] in
    benchmarks/gpu/sharding.py)."""
    import os

    late = [
        f"{a} / {b}"
        for a, rows in results.items()
        for b, r in rows.items()
        if r.get("profiler_sessions_before", 0) > sessions_at_start
    ]
    return {"rows": late, "sessions_before_part": sessions_at_start, "TEARDOWN_CUPTI": os.environ.get("TEARDOWN_CUPTI")}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def mib(v: int | None) -> str:
    if v is None:
        return "-"
    return f"{v / MIB:.0f}" if abs(v) >= 10 * MIB else f"{v / MIB:.2f}"
