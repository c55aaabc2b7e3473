"""A few real steps of the top configurations memfit.autoconfigure priced, the fastest expected
kept (measured weighed against the scaled price). See [Note: Trying configurations]."""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from memfit._plan._budget import format_bytes
from memfit._plan._plan import PlanError
from memfit.memory import allocator_of

if TYPE_CHECKING:
    from memfit._plan._candidate import Candidate, Searched

S = TypeVar("S", bound="Searched")  # the search measured: memfit._plan._autoconfig.AutoConfig

# [Note: Trying configurations]
# The time model prices a step without running it; where it is off by more than the gap between
# the top configurations, the ranking it gives is wrong (on gloo CPU ranks priced steps measured
# 0.94 to 1.65x their price, benchmarks/results/autoconfig_*cpu*.md; on a GPU it has not been
# checked). AutoConfig.measure(step_of, top=k) settles it with real steps, as DeepSpeed's
# autotuner does for every configuration, here for the k fastest predicted that fit: each in
# turn, step_of(candidate) builds it (the caller's model, its sharding and optimizer; one
# configuration alive at a time) and returns one training step; `warmup` steps run, then
# `steps` more, each between barriers and timed on the slowest rank, the device synchronised
# (the current accelerator, else the CPU; `device=` says otherwise); a candidate's time is their
# median. Where the device's allocator keeps statistics its peak over those steps (the largest
# rank's) is read too, and a configuration over the budget there is refused ("memory: measured
# ..."): the check a forecast of tensor bytes cannot make of allocator rounding and workspace.
# An out-of-memory error while building or running one is refused too, on every rank (they
# agree after each candidate), its memory freed and the allocator's cache emptied; every one
# refused raises PlanError. An error raised on some ranks only, inside a collective, leaves the
# others waiting: the process group's timeout ends them. The pick is the most tokens per second
# expected (below; times and peaks all-reduced: the same pick on every rank); the others run
# follow it, then the refused, then those not measured in the order priced. Every rank of the
# searched world size calls it with the same result, as it calls any collective; one process
# without a process group measures a search for world size 1.
#
# The trials also say how far this machine runs this model's steps from their price, and how far
# apart their own repeats are; both go into each configuration's expected step:
#   trial_scale   s = the median over the k configurations run of measured / priced;
#   noise         v = pi / 2 x the mean over them of their steps' variance / median^2, / steps:
#                 the relative variance of a median of that many steps (steps normal about it);
#   the miss      r = the sum over them of (measured / (s x priced) - 1)^2 / (k - 1), less v
#                 (>= 0): what the scaled price gets wrong beyond the noise;
#   trial_weight  w = r / (r + v): the positive-part empirical-Bayes weight of a measurement
#                 against a prior of spread r (1 where there is no spread to weigh: one step, steps
#                 that did not vary, or one configuration run);
# a run's expected step is w x measured + (1 - w) x s x priced, one not run s x priced, and the
# pick is the most tokens/s expected among the runs. Where the runs scatter about the scaled
# price no more than their noise explains (w = 0) the priced order decides; where the noise is
# small beside the price's miss, w nears 1 and the measured times decide, as DeepSpeed's
# autotuner lets them. v counts only the spread of a configuration's own consecutive steps, not
# the machine's drift between configurations tried one after another, which on this 2-core
# machine was larger (a configuration's trial against its time in a grid measured minutes
# apart: 0.72 to 1.11x, docs/planning.md): w leans to the measured more than that drift
# warrants. Why weigh at all: on gloo CPU ranks the price misses mostly the same way across a
# model's configurations (every step of benchmarks/results/autoconfig_trials_cpu_third.md
# measured 1.04 to 1.45x its price, a model's configurations within 0.09 to 0.36 of each other
# in that ratio), while one configuration's steps spread widely (their interquartile range 8 to
# 43% of their median in ..._fourth.md), more than the gaps between the top configurations. What
# benchmarks/autoconfig.py measured of the weighing: docs/planning.md.

_clock = time.perf_counter  # the tests' fake clock replaces it


def measure(result: S, step_of: Callable, top: int, steps: int, warmup: int, group, device) -> S:
    """AutoConfig.measure's work (see its docstring and [Note: Trying configurations])."""
    if top < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"AutoConfig.measure: top={top} and steps={steps} take 1 or more, warmup={warmup} 0 or more")
    ranks = _ranks(group)
    if ranks != result.best.layout.world_size:
        raise ValueError(
            f"AutoConfig.measure: the search is for world size {result.best.layout.world_size}, but this runs on "
            f"{ranks} (the process group's ranks, 1 without one): call it on every rank of the world size searched"
        )
    work = torch.device(device) if device is not None else _work_device()
    comm = _comm_device(group, work)
    tried = [c for c in result.candidates if c.fits][:top]
    timed: list[Candidate] = []
    refused: list[Candidate] = []  # out of memory, or over the budget on the device's allocator
    runs: list[tuple[float, float, float]] = []  # per configuration run: median, price, steps' variance / median^2
    allocator = allocator_of(work)  # None: no peaks to read (a CPU)
    from memfit._shard import _runtime

    for c in tried:
        took, peak, failed = [], None, ""
        before = set(_runtime._IN_FLIGHT)  # root states between a forward and its backward's end
        try:
            step = step_of(c)
            for _ in range(warmup):
                step()
            if allocator is not None:
                allocator.reset_peak_memory_stats(work)
            took = [_timed(step, group, work, comm) for _ in range(steps)]
            peak = None if allocator is None else int(allocator.max_memory_allocated(work))
        except torch.OutOfMemoryError as e:  # on every rank alike (one rank alone: see the Note)
            failed = f"memory: out of memory when run ({str(e).splitlines()[0][:80]})"
        step = None
        _runtime._IN_FLIGHT.intersection_update(before)  # a step cut short holds its model there
        gc.collect()  # the configuration's model and optimizer go before the next is built
        if work.type != "cpu" and allocator is not None:
            torch.get_device_module(work.type).empty_cache()  # its cached blocks too
        if _largest(float(bool(failed)), group, comm):  # every rank refuses what any rank could not run
            refused.append(dataclasses.replace(c, lost=failed or "memory: out of memory on another rank"))
            continue
        peak = None if peak is None else int(_largest(float(peak), group, comm))
        median = statistics.median(took)
        spread = statistics.variance(took) / median**2 if len(took) > 1 and median > 0 else 0.0
        runs.append((median, c.step_time, spread))
        measured = dataclasses.replace(c, measured=median, measured_peak=peak)
        if peak is not None and peak > result.budget:
            refused.append(
                dataclasses.replace(measured, lost=f"memory: measured {format_bytes(peak)}, over the budget")
            )
        else:
            timed.append(measured)
    if not timed:
        why = "; ".join(f"{c.layout.describe()}, micro-batch {c.micro_batch}: {c.lost}" for c in refused)
        raise PlanError(
            f"AutoConfig.measure: every configuration tried ran out of memory or measured over the budget of "
            f"{format_bytes(result.budget)} per rank on the device ({why}): pass a smaller budget, or try more "
            "configurations (top=; memfit train --trials)"
        )
    # every run, over the budget too (its time is still a step's); see [Note: Trying configurations]
    scale, weight = _scale_and_weight([(m, p) for m, p, _ in runs], statistics.fmean(v for *_, v in runs), steps)
    timed = [dataclasses.replace(c, expected=_expected(c, scale, weight)) for c in timed]
    per_second = {id(c): c.samples * result.tokens_per_sample / max(c.expected or 0.0, 1e-12) for c in timed}
    ranked = sorted(timed, key=lambda c: -per_second[id(c)])  # stable: ties keep the priced order
    best = ranked[0]
    out = [dataclasses.replace(best, lost="")]
    for c in ranked[1:]:
        slower = 1 - per_second[id(c)] / per_second[id(best)]
        out.append(dataclasses.replace(c, lost=f"tried: {slower:.1%} fewer tokens/s expected than the pick"))
    out += refused
    for c in result.candidates:
        if not any(c is t for t in tried):
            lost = f"not measured: priced below the top {top}"
            out.append(dataclasses.replace(c, lost=lost, expected=scale * c.step_time) if c.fits else c)
    return dataclasses.replace(result, best=out[0], candidates=tuple(out), trial_scale=scale, trial_weight=weight)


def _expected(c: Candidate, scale: float, weight: float) -> float:
    """A run's expected step: ``weight`` x its measured time + the rest x its price x ``scale``."""
    assert c.measured is not None
    return weight * c.measured + (1 - weight) * scale * c.step_time


def _scale_and_weight(runs: list[tuple[float, float]], spread: float, steps: int) -> tuple[float, float]:
    """(trial_scale, trial_weight) of [Note: Trying configurations] from the (measured, priced)
    seconds of the configurations run and the mean variance of their steps over their median
    squared (``spread``), ``steps`` steps each."""
    scale = statistics.median(m / p for m, p in runs)
    noise = math.pi / 2 * spread / steps  # a median's variance, relative: pi / 2 x the steps' over their count
    if noise <= 0.0 or scale <= 0.0 or len(runs) < 2:
        return scale, 1.0  # no spread to weigh (one step, steps that did not vary, one run): the measured stand
    k = len(runs)  # the scale is fitted to the same runs: k - 1 of them left to scatter about it
    scatter = sum((m / (scale * p) - 1) ** 2 for m, p in runs) / (k - 1)
    miss = max(scatter - noise, 0.0)  # what the scaled price misses, the measurements' noise left out
    return scale, miss / (miss + noise)


def describe(c: Candidate) -> str:
    """The line AutoConfig's table adds for a measured pick."""
    assert c.measured is not None
    peak = "" if c.measured_peak is None else f"; peak {format_bytes(c.measured_peak)} per rank (the allocator's)"
    expected = "" if c.expected is None else f"; expected {c.expected * 1e3:.3g} ms"
    return (
        f"  measured step {c.measured * 1e3:.3g} ms (the slowest rank's median) against {c.step_time * 1e3:.3g} ms "
        f"predicted: {c.measured / c.step_time:.2f}x{expected}{peak}"
    )


def _together() -> bool:
    """Whether this process is in a process group (else it measures alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _ranks(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if _together() else 1


def _work_device() -> torch.device:
    """Where the steps compute: this process's current accelerator, else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())  # pragma: no cover (a GPU)


def _comm_device(group, work: torch.device) -> torch.device:
    """Where the group's collectives take tensors (memfit/_shard/_device.compute_device)."""
    import torch.distributed as dist

    if not _together():
        return work
    from memfit._shard._device import compute_device

    return compute_device(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]


def _timed(step: Callable[[], object], group, work: torch.device, comm: torch.device) -> float:
    """Seconds of one ``step`` between barriers, the slowest rank's (this process's alone
    without a process group)."""
    import torch.distributed as dist

    from memfit._plan._calibrate import _sync

    if _together():
        dist.barrier(group)
    _sync(work)
    t0 = _clock()
    step()
    _sync(work)
    return _largest(_clock() - t0, group, comm)


def _largest(value: float, group, device: torch.device) -> float:
    """The largest of every rank's ``value``, this process's alone without a process group."""
    from memfit._plan._calibrate import _slowest

    return _slowest(value, group, device) if _together() else value


__all__ = ["describe", "measure"]
