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
    ``aten._local_scalar_dense`` calls while active (a context manager), and the copies from
    the host to an accelerator that block the host: ``torch.tensor(data, device=...)``
    (pageable, as are all its copies) and ``copy_`` / ``to`` from a host tensor without
    ``non_blocking=True``.

    A call that goes through another (``if t > 0`` runs ``__bool__``, which runs
    ``_local_scalar_dense``) counts once: the outermost call. ``.calls`` holds the names;
    ``.in_backward`` those made while autograd ran a backward (its hooks and callbacks).
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_backward: list[str] = []
        self._depth = 0
        self._saved: dict[str, Callable] = {}
        self._tensor: Callable | None = None
        self._mode: _ScalarMode | None = None

    @property
    def count(self) -> int:
        return len(self.calls)

    def _add(self, name: str) -> None:
        self.calls.append(name)
        if torch._C._current_graph_task_id() != -1:
            self.in_backward.append(name)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self._depth == 0:
                self._add(name)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_tensor(self, fn: Callable) -> Callable:
        def tensor(data, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu" and self._depth == 0:
                self._add("tensor(device=...)")
            return fn(data, *args, **kwargs)

        return tensor

    def __enter__(self) -> HostSyncCounter:
        for name in _SYNC_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        self._tensor = torch.tensor
        torch.tensor = self._wrap_tensor(torch.tensor)  # invisible to dispatch modes
        self._mode = _ScalarMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._mode is not None and self._tensor is not None  # entered
        self._mode.__exit__(*exc)
        torch.tensor = self._tensor
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


class _ScalarMode(TorchDispatchMode):
    """Sees ``aten._local_scalar_dense`` reached without a counted Tensor method (C++ callers)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter._depth == 0:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.counter._add("_local_scalar_dense")
            elif _blocking_upload(func, args, kwargs):
                self.counter._add(f"{func.overloadpacket.__name__}(host->device, blocking)")
        return func(*args, **kwargs)


def _blocking_upload(func, args, kwargs) -> bool:
    """Whether ``func`` copies a host tensor to an accelerator and makes the host wait for it."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        to = dst.device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    elif func is torch.ops.aten._to_copy.default:
        src, to = args[0], kwargs.get("device")
        non_blocking = kwargs.get("non_blocking", False)
    else:
        return False
    return to is not None and src.device.type == "cpu" and torch.device(to).type != "cpu" and not non_blocking


# Ops that launch no kernel: allocations, and the profiler's record_function markers.
_NOT_KERNELS = ("empty", "_record_function")


def _foreach_launches(args) -> int:
    """Kernels a ``_foreach_*`` op launches on CUDA: one (multi_tensor_apply) on its fast path,
    where every tensor list holds one dtype on one device and the lists' tensors pair up with
    equal sizes and strides, all dense (``can_use_fast_route`` in ATen's ForeachUtils.h; a copy
    may cast between its two lists, as FSDP2's mixed-precision copy-in does); else one per
    tensor (the slow path loops over them)."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return 1
    first = lists[0]
    for ts in lists:
        if len({(t.dtype, t.device) for t in ts}) != 1 or not all(t.is_contiguous() for t in ts):
            return len(first)
        if any(t.shape != u.shape or t.stride() != u.stride() for t, u in zip(ts, first)):
            return len(first)
    return 1


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher while active, by name.

    ``launches`` counts the ops that launch kernels on an accelerator: it leaves out views
    (metadata only), allocations and profiler markers, counts a custom op (FSDP2's
    ``fsdp::all_gather_copy_in``) as one, not the aten ops it runs inside (which the mode may
    or may not see, depending on how it is registered), and a ``_foreach_*`` op as CUDA runs
    it: one launch on its fast path, one per tensor off it (see :func:`_foreach_launches`);
    ``total`` counts all that it sees.
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
            self.kernels[name] += _foreach_launches(args) if name.startswith("_foreach_") else 1
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
