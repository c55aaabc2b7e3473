"""Hooks for tests of memfit and of code built on it: counters and views of internal state.

Not part of the stable API (names may change between releases); nothing here is needed to
train. What is here: counters (host syncs, ops, collectives, offload), the stream trace and
the switches of memfit._instrument.HOOKS (See [Note: Instrumentation switches]), views of
internal state, the pretend accelerator, and the process-group helpers the CLI uses. Tests
that need an internal class or function (the planner's profile and solver, a parameter's
layout) import it from its own module.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch
from torch import nn

from memfit._checkpoint._function import _Frame, _Holder
from memfit._checkpoint._host import cpu_as_device as host_offload_on_cpu
from memfit._checkpoint._host import offloadable
from memfit._checkpoint._pinned import STATS as _OFFLOAD_STATS
from memfit._checkpoint._pinned import OffloadStats
from memfit._instrument import Hooks, Trace, switched
from memfit._persist import _checkpoint_files
from memfit._shard._collectives import STATS, CommStats
from memfit._shard._counters import HostSyncCounter, OpCounter
from memfit._shard._device import audit as device_audit
from memfit._shard._unit import ShardedModule
from memfit.cli._bench_dist import run_distributed  # the CLI's pieces, for benchmarks timing steps as `memfit bench`
from memfit.cli._launch import end_process_group, free_port, init_process_group, spawn

__all__ = [
    "HostSyncCounter",
    "OpCounter",
    "Trace",
    "checkpoint_checksums",
    "checkpoint_chunks",
    "collective_stats",
    "debug_collectives",
    "device_audit",
    "end_process_group",
    "fake_allocator",
    "free_port",
    "held_recomputed_tensors",
    "host_offload_on_cpu",
    "init_process_group",
    "live_checkpoint_frames",
    "meta_accelerator",
    "offload_stats",
    "offload_writer",
    "offloadable",
    "placed_optimizer_state",
    "run_distributed",
    "save_steps",
    "sharded_units",
    "spawn",
    "trace_streams",
]


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


def offload_writer(
    write: Callable[[str, torch.Tensor, Callable[[str, torch.Tensor], None]], None],
) -> contextlib.AbstractContextManager[Hooks]:
    """Route ``offload="disk"`` writes through ``write(path, tensor, real_write)`` (fault injection)."""
    return switched(offload_write=write)


@contextlib.contextmanager
def trace_streams() -> Iterator[Trace]:
    """Record the streams' records, waits and buffer notes (sharding and host offload) made
    inside into the yielded `Trace`; ``trace.violations()`` checks the ordering rules."""
    trace = Trace()
    with switched(trace=trace):
        yield trace


def debug_collectives(on: bool = True) -> contextlib.AbstractContextManager[Hooks]:
    """As ``MEMFIT_DEBUG_COLLECTIVES=1`` for roots set up inside: every collective checked at once."""
    return switched(debug_collectives=on)


def offload_stats() -> OffloadStats:
    """This process's counters of offload (copies and bytes each way, prefetches, shared
    copies, kept tensors; pinned host buffers allocated and reused) and ``pinned_bytes``, the
    bytes of pinned host buffers held now (a gauge, with ``pinned_peak``); ``.reset()`` zeroes
    the counters and restarts ``pinned_peak`` from ``pinned_bytes``."""
    return _OFFLOAD_STATS


def checkpoint_chunks(path: str) -> dict[str, tuple[str, int, int]]:
    """Where a sharded checkpoint stores each tensor chunk: {name: (file, offset, bytes)} (for
    tests that damage bytes on purpose)."""
    meta = _checkpoint_files._read_metadata(path)
    return {name: (rel, off, n) for name, rel, off, n in _checkpoint_files._chunks(meta)}


def checkpoint_checksums(enabled: bool) -> contextlib.AbstractContextManager[Hooks]:
    """Turn the per-chunk checksums of save_checkpoint on or off (to measure what they cost)."""
    return switched(checksums=enabled)


def save_steps(hook: Callable[[str], None] | None) -> contextlib.AbstractContextManager[Hooks]:
    """Call ``hook(name)`` at each named step of a save or an export (tests kill the process there)."""
    return switched(save_step=hook)


_META_BACKEND = "memfit_meta"


@contextlib.contextmanager
def meta_accelerator(world_size: int = 1, rank: int = 0, *, with_gloo: bool = False) -> Iterator[object]:
    """A default process group that, like NCCL, takes tensors of one device only: ``meta``,
    the pretend accelerator (yields the group). ``with_gloo``: a group of two backends, gloo
    for host tensors beside the pretend accelerator's, as ``init_process_group("cpu:gloo,
    cuda:nccl")`` makes one (one rank only: gloo's ranks are real processes). Collectives do nothing (no process meets
    another: ``world_size`` ranks are simulated in this one) and meta tensors hold no values,
    so it checks where tensors are, not what they hold: a CPU tensor in a collective fails
    with NCCL's "No backend type associated with device type cpu", an op mixing CPU and meta
    tensors fails as one mixing CPU and CUDA tensors does, and a host read of a device value
    fails unless it goes through memfit's one counted read. Streams, pinned memory, the
    overlap of copies and allocator peaks need a real GPU."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    if dist.is_initialized():
        raise RuntimeError("memfit.testing.meta_accelerator: a default process group exists already; destroy it first")
    if _META_BACKEND.upper() not in dist.Backend._plugins:

        def create(common, backend_options):
            return FakeProcessGroup._create_internal(common.group_rank, common.group_size, backend_options)

        dist.Backend.register_backend(_META_BACKEND, create, extended_api=True, devices=["meta"])
    if with_gloo and world_size != 1:
        raise ValueError("memfit.testing.meta_accelerator: with_gloo needs world_size=1 (gloo ranks are processes)")
    backend = f"cpu:gloo,meta:{_META_BACKEND}" if with_gloo else _META_BACKEND
    dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def fake_allocator(module) -> contextlib.AbstractContextManager[Hooks]:
    """Make MemoryMeter read allocator peaks from ``module`` (a stand-in for ``torch.cuda``
    with ``is_available``, ``synchronize``, ``reset_peak_memory_stats``,
    ``max_memory_allocated`` and ``max_memory_reserved``), whatever the device."""
    return switched(allocator=module)


def placed_optimizer_state(value: torch.Tensor, param: torch.Tensor, group: dict, key: str) -> torch.Tensor:
    """Where load_checkpoint puts a loaded, non-sharded optimizer state tensor (``step``, ...)."""
    return _checkpoint_files.placed_state(value, param, group, key)
