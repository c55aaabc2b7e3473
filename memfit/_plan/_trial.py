"""A few real steps of the top configurations memfit.autoconfigure priced, the fastest measured
kept. See [Note: Trying configurations]."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from memfit._plan._budget import format_bytes
from memfit._plan._plan import PlanError

if TYPE_CHECKING:
    from memfit._plan._autoconfig import AutoConfig, Candidate

# [Note: Trying configurations]
# The time model prices a step without running it; where it is off by more than the gap between
# the top configurations, the ranking it gives is wrong (on gloo CPU ranks priced steps measured
# 0.94 to 1.48x their price, benchmarks/results/autoconfig_memfit_replicated_cpu*.md; on a GPU it
# has not been checked). AutoConfig.measure(step_of, top=k) settles it with real steps, as
# DeepSpeed's autotuner does for every configuration, here for the k fastest predicted that fit:
# each in turn, step_of(candidate) builds it (the caller's model, its sharding and optimizer; one
# configuration alive at a time, each within the budget as forecast) and returns one training
# step; `warmup` steps run, then `steps` more, each between barriers and timed on the slowest
# rank; a candidate's time is their median. On an accelerator the allocator's peak over those
# steps (the largest rank's) is read too: a configuration over the budget there is not picked
# ("memory: measured ..."; every one over raises PlanError), the check a forecast of tensor
# bytes cannot make of allocator rounding and workspace (not run here: a CPU has no allocator
# statistics). The pick is the most tokens per second measured
# (the times are all-reduced: the same pick on every rank); the others measured follow it by
# measured tokens per second, those not measured after them in the order priced. Every rank
# calls it with the same result, as it calls any collective; one with no process group (or of
# one rank) times its own steps.

_clock = time.perf_counter  # the tests' fake clock replaces it


def measure(
    result: AutoConfig,
    step_of: Callable[[Candidate], Callable[[], object]],
    *,
    top: int = 3,
    steps: int = 5,
    warmup: int = 2,
    group=None,
) -> AutoConfig:
    """``result`` with its ``top`` fitting configurations measured and the fastest of them
    picked (see [Note: Trying configurations] and :meth:`AutoConfig.measure`)."""
    from memfit._plan._autoconfig import _samples

    if top < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"AutoConfig.measure: top={top} and steps={steps} take 1 or more, warmup={warmup} 0 or more")
    device = _device(group)
    tried = [c for c in result.candidates if c.fits][:top]
    timed: list[Candidate] = []
    over: list[Candidate] = []  # measured over the budget (an accelerator)
    for c in tried:
        step = step_of(c)
        for _ in range(warmup):
            step()
        _peak_bytes(device, reset=True)
        took = [_timed(step, group, device) for _ in range(steps)]
        peak = _peak_bytes(device)
        del step
        gc.collect()  # the configuration's model and optimizer go before the next is built
        peak = None if peak is None else int(_largest(float(peak), group, device))
        measured = dataclasses.replace(c, measured=statistics.median(took), measured_peak=peak)
        (over if peak is not None and peak > result.budget else timed).append(measured)
    if not timed:
        peaks = ", ".join(f"{c.layout.describe()} {format_bytes(c.measured_peak or 0)}" for c in over)
        raise PlanError(
            f"AutoConfig.measure: every configuration tried went over the budget of {format_bytes(result.budget)} "
            f"per rank on the device ({peaks}): its allocator needs more than the forecast; pass a smaller budget"
        )
    per_second = {id(c): _samples(c) * result.tokens_per_sample / max(c.measured or 0.0, 1e-12) for c in timed}
    ranked = sorted(timed, key=lambda c: -per_second[id(c)])  # stable: ties keep the priced order
    best = ranked[0]
    out = [dataclasses.replace(best, lost="")]
    for c in ranked[1:]:
        slower = 1 - per_second[id(c)] / per_second[id(best)]
        out.append(dataclasses.replace(c, lost=f"measured: {slower:.1%} fewer tokens/s than the pick"))
    for c in over:
        out.append(
            dataclasses.replace(c, lost=f"memory: measured {format_bytes(c.measured_peak or 0)}, over the budget")
        )
    for c in result.candidates:
        if not any(c is t for t in tried):
            out.append(dataclasses.replace(c, lost=f"not measured: priced below the top {top}") if c.fits else c)
    return dataclasses.replace(result, best=out[0], candidates=tuple(out))


def describe(c: Candidate) -> str:
    """The line AutoConfig's table adds for a measured pick."""
    assert c.measured is not None
    peak = "" if c.measured_peak is None else f"; peak {format_bytes(c.measured_peak)} per rank (the allocator's)"
    return (
        f"  measured step {c.measured * 1e3:.3g} ms (the slowest rank's median) against {c.step_time * 1e3:.3g} ms "
        f"predicted: {c.measured / c.step_time:.2f}x{peak}"
    )


def _peak_bytes(device: torch.device, reset: bool = False) -> int | None:
    """The device allocator's peak since the last reset (``reset``: start again; None where the
    device has no allocator statistics: a CPU)."""
    if device.type == "cpu":
        return None
    accelerator = torch.get_device_module(device.type)  # pragma: no cover (needs a GPU)
    if reset:  # pragma: no cover
        accelerator.reset_peak_memory_stats(device)
        return None
    return int(accelerator.max_memory_allocated(device))  # pragma: no cover


def _device(group) -> torch.device:
    """Where the group's collectives run: the current GPU on NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # pragma: no cover (needs a GPU)
    return torch.device("cpu")


def _timed(step: Callable[[], object], group, device: torch.device) -> float:
    """Seconds of one ``step`` between barriers, the slowest rank's (this process's alone
    without a process group)."""
    import torch.distributed as dist

    from memfit._plan._calibrate import _sync

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    _sync(device)
    t0 = _clock()
    step()
    _sync(device)
    return _largest(_clock() - t0, group, device)


def _largest(value: float, group, device: torch.device) -> float:
    """The largest of every rank's ``value`` (this process's alone without a process group)."""
    import torch.distributed as dist

    from memfit._plan._calibrate import _slowest

    return _slowest(value, group, device) if dist.is_available() and dist.is_initialized() else value


__all__ = ["describe", "measure"]
