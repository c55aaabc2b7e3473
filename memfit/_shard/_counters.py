"""Counters of what a sharded step costs the host: device-to-host synchronisations and aten ops.

Tests and benchmarks use them to hold the hot-path invariants (at most one host sync per
step, ops per unit independent of parameter count and world size) and to count torch FSDP2
the same way. On a CPU nothing waits, but every call counted here would stop the host until
the device drains on an accelerator.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a value to the host (each one a device sync on an accelerator).
_SYNC_METHODS = ("item", "tolist", "__bool__")
# c10d ops that move data: which argument holds the full buffer of the ring, and how many times
# (W-1)/W of it a rank sends (an all-reduce is a reduce-scatter then an all-gather). memfit's
# reduce-scatter on gloo is an all-to-all on 2 ranks, else an all-reduce (see
# memfit/_shard/_collectives.py); an all-to-all sends its input but what it sends to itself.
_WIRE = {"_allgather_base_": (0, 1), "_reduce_scatter_base_": (1, 1), "allreduce_": (0, 2)}


# c10d ops: where their process group is among the arguments.
_GROUP_ARG = {"_allgather_base_": 2, "_reduce_scatter_base_": 2, "allreduce_": 1, "alltoall_base_": 2}


def _group_of(name: str, args) -> tuple[int, int]:
    """(rank, size) in the process group the c10d op ``name`` runs on."""
    group = dist.ProcessGroup.unbox(args[_GROUP_ARG[name]])
    return group.rank(), group.size()


def _all_to_all_bytes(args) -> float:
    inp, splits = args[1], args[4]  # (output, input, group, output_split_sizes, input_split_sizes, ...)
    rank, world = _group_of("alltoall_base_", args)
    own = splits[rank] * inp[0].numel() if splits else inp.numel() / world
    return (inp.numel() - own) * inp.element_size()


class HostSyncCounter:
    """Counts ``Tensor.item``, ``Tensor.tolist``, ``Tensor.__bool__`` and
    ``aten._local_scalar_dense`` calls while active (a context manager).

    A call that goes through another (``if t > 0`` runs ``__bool__``, which runs
    ``_local_scalar_dense``) counts once: the outermost call. ``.calls`` holds the names.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._depth = 0
        self._saved: dict[str, Callable] = {}
        self._mode: _ScalarMode | None = None

    @property
    def count(self) -> int:
        return len(self.calls)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls.append(name)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> HostSyncCounter:
        for name in _SYNC_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        self._mode = _ScalarMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._mode is not None  # entered
        self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


class _ScalarMode(TorchDispatchMode):
    """Sees ``aten._local_scalar_dense`` reached without a counted Tensor method (C++ callers)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and self.counter._depth == 0:
            self.counter.calls.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


# Ops that launch no kernel: allocations, and the profiler's record_function markers.
_NOT_KERNELS = ("empty", "_record_function")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher while active, by name.

    ``launches`` counts the ops that launch kernels on an accelerator: it leaves out views
    (metadata only), allocations and profiler markers, and counts a custom op (FSDP2's
    ``fsdp::all_gather_copy_in``) as one, not the aten ops it runs inside (which the mode may
    or may not see, depending on how it is registered); ``total`` counts all that it sees.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.wire_bytes = 0.0  # ring bytes this rank sends (see _WIRE)
        self._inside_custom = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in _WIRE:
            arg, times = _WIRE[name]
            world = _group_of(name, args)[1]
            for t in args[arg] if isinstance(args[arg], list) else [args[arg]]:
                self.wire_bytes += times * t.numel() * t.element_size() * (world - 1) / world
        elif name == "alltoall_base_":
            self.wire_bytes += _all_to_all_bytes(args)
        if not func.is_view and not name.startswith(_NOT_KERNELS) and not self._inside_custom:
            self.kernels[name] += 1
        if func.namespace in ("aten", "c10d", "prims"):
            return func(*args, **(kwargs or {}))
        self._inside_custom += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._inside_custom -= 1

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())
