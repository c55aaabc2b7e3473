"""Hooks for tests of memfit and of code built on it: counters and views of internal state.

Not part of the stable API (names may change between releases); nothing here is needed to
train. memfit's own tests reach internals only through this module.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch
from torch import nn

from memfit._checkpoint import _offload
from memfit._checkpoint._function import _Frame, _Holder
from memfit._plan._profile import DECISIONS, BlockProfile, ModelProfile
from memfit._plan._solve import Sharding, forecast, smallest_budget, solve, terms
from memfit._plan._time import PROFILES, OpCost, calibrate, device_profile
from memfit._plan._validate import measured_sharded_peak
from memfit._shard import _checkpoint_files
from memfit._shard._collectives import STATS, CommStats
from memfit._shard._mixed import _NORMS
from memfit._shard._param import ShardedParam
from memfit._shard._unit import ShardedModule
from memfit.cli._launch import free_port

__all__ = [
    "DECISIONS",
    "NORM_LAYERS",
    "PROFILES",
    "BlockProfile",
    "ModelProfile",
    "OpCost",
    "ShardedParam",
    "Sharding",
    "calibrate",
    "checkpoint_checksums",
    "checkpoint_chunks",
    "collective_stats",
    "device_profile",
    "forecast",
    "free_port",
    "held_recomputed_tensors",
    "live_checkpoint_frames",
    "measured_sharded_peak",
    "offload_writer",
    "sharded_units",
    "smallest_budget",
    "solve",
    "terms",
]
# The planner's pieces, for tests that build a profile by hand: DECISIONS (the decision kinds),
# BlockProfile / ModelProfile (what plan() measures), Sharding (per-rank accounting),
# terms / forecast / solve (the memory model and the solver on a profile).
# ShardedParam: one parameter's chunk and slot layout, built without a process group (unit tests).
# smallest_budget: the least budget the solver fits a profile into (what PlanError reports).

NORM_LAYERS: tuple[type[nn.Module], ...] = _NORMS
"""The module classes whose parameters mixed precision keeps in full precision."""


def collective_stats() -> CommStats:
    """This process's counters of sharding's collectives (calls and ring bytes), in total and per
    process group (``.of(group)``, ``.by_group``); ``.reset()`` them."""
    return STATS


def sharded_units(model: nn.Module) -> list:
    """The sharding units of ``model`` in ``modules()`` order (the runtime objects, for inspection)."""
    return [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]


def live_checkpoint_frames() -> int:
    """How many checkpointed calls' recompute frames are alive (0 once their backward is done)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is _Frame)


def held_recomputed_tensors() -> list[torch.Tensor]:
    """Recomputed tensors that checkpointed calls still hold for a backward not yet run."""
    return [t for o in gc.get_objects() if type(o) is _Holder for t in o.values.values()]


@contextlib.contextmanager
def offload_writer(write: Callable[[str, torch.Tensor, Callable[[str, torch.Tensor], None]], None]) -> Iterator[None]:
    """Route ``offload="disk"`` writes through ``write(path, tensor, real_write)`` (fault injection)."""
    real = _offload._write
    _offload._write = lambda path, t: write(path, t, real)
    try:
        yield
    finally:
        _offload._write = real


# Counting the host's cost of a sharded step (tests and benchmarks/sharding_overhead.py).
from memfit._shard._counters import HostSyncCounter, OpCounter  # noqa: E402

__all__ += ["HostSyncCounter", "OpCounter"]

# The streams' trace: every wait, record, allocation, use and free, and the ordering check.
from memfit._shard._streams import StreamTrace  # noqa: E402
from memfit._shard._streams import tracing as trace_streams  # noqa: E402

__all__ += ["StreamTrace", "trace_streams"]


@contextlib.contextmanager
def debug_collectives(on: bool = True) -> Iterator[None]:
    """As ``MEMFIT_DEBUG_COLLECTIVES=1`` for roots set up inside: every collective checked at once."""
    from memfit._shard import _checks

    saved, _checks.DEBUG_COLLECTIVES = _checks.DEBUG_COLLECTIVES, on
    try:
        yield
    finally:
        _checks.DEBUG_COLLECTIVES = saved


__all__ += ["debug_collectives"]


def checkpoint_chunks(path: str) -> dict[str, tuple[str, int, int]]:
    """Where a sharded checkpoint stores each tensor chunk: {name: (file, offset, bytes)} (for
    tests that damage bytes on purpose)."""
    meta = _checkpoint_files._read_metadata(path)
    return {name: (rel, off, n) for name, rel, off, n in _checkpoint_files._chunks(meta)}


@contextlib.contextmanager
def checkpoint_checksums(enabled: bool) -> Iterator[None]:
    """Turn the per-chunk checksums of save_checkpoint on or off (to measure what they cost)."""
    before = _checkpoint_files._CHECKSUMS
    _checkpoint_files._CHECKSUMS = enabled
    try:
        yield
    finally:
        _checkpoint_files._CHECKSUMS = before
