"""`memfit.MemoryMeter`: the peak of live tensor storage bytes on one device."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from memfit._instrument import HOOKS

# [Note: How MemoryMeter counts]
# Inside the region a TorchDispatchMode sees every aten op. Each tensor an op reads or writes
# is reduced to its storage (views share one), and each storage is counted once, by its
# bytes, while it is alive (a c10 weak reference tells when it is freed). The peak is taken
# after every op, once its outputs exist: memory only grows at allocations, so this is the
# exact peak of the storages that tensors hold. Storages resized in place (how sharding frees
# and refills parameters) are re-measured at each resize. It does not see allocator rounding or
# scratch buffers used inside a kernel; that makes it deterministic on the CPU, where no
# allocator statistics exist. On CUDA the allocator's own peak is reported beside it.
# Tensors that existed before the region count from the moment an op first touches them;
# the parameters, buffers, gradients and optimizer state of a given model and optimizer
# count from the start. At each new peak the live bytes are split into named categories.

__all__ = ["MemoryMeter"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations_and_other")
_PLAIN = (torch.Tensor, nn.Parameter, FakeTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the memory: a DTensor's local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class _Mode(TorchDispatchMode):
    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            return NotImplemented  # a tensor subclass (DTensor): let it run its local ops, seen below
        kwargs = kwargs or {}
        self.meter._track_all(_tensors((args, kwargs), []))
        out = func(*args, **kwargs)
        self.meter._track_all(_tensors(out, []))
        self.meter._update_peak()
        return out


def _tensors(x: object, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested tuples, lists, dicts: what pytree's
    tree_flatten finds in them, without its per-node bookkeeping, which the planner pays for
    on every op of a traced step)."""
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, list | tuple):
        for y in x:
            _tensors(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, found)
    return found


class MemoryMeter:
    """Measure the peak of live tensor storage bytes on ``device`` during a ``with`` block.

    Each storage counts once (views add nothing), from the first op that touches it until it
    is freed; the parameters, buffers, gradients and optimizer state of ``model`` and
    ``optimizer`` count from the start. Allocator rounding and kernel scratch space are not
    seen, which makes the count deterministic on the CPU.

    Args:
        device: the device to measure (default: where ``model`` computes: its first
            parameter's device, for a sharded model the device its units gather on, even when
            the shards are offloaded to host memory; else the CPU).
        model: its parameters, buffers and gradients are counted from the start and named in
            :meth:`breakdown`.
        optimizer: its state tensors are counted from the start and named in :meth:`breakdown`.

    After the block: ``peak_bytes`` (int), :meth:`breakdown` (bytes per category at the peak),
    ``current_bytes`` (what is still alive of what it saw) and, on CUDA, the caching
    allocator's peaks during the block beside the live tensor bytes: ``allocator_peak_bytes``
    (``torch.cuda.max_memory_allocated``: allocator rounding and kernel scratch space
    included) and ``allocator_reserved_peak_bytes`` (``max_memory_reserved``: what the
    allocator held from the driver, cached free blocks included); None elsewhere.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else _default_device(model)
        self.model = model
        self.optimizer = optimizer
        self.peak_bytes = 0
        self.allocator_peak_bytes: int | None = None
        self.allocator_reserved_peak_bytes: int | None = None
        self._peak_breakdown = dict.fromkeys(CATEGORIES, 0)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (ref, bytes)
        self._total = 0  # bytes in _live, freed entries included until the next sweep
        self._mode: _Mode | None = None
        # Fake tensors (shapes, no data) count only for a meter opened under FakeTensorMode,
        # as the planner does (bytes from shapes); a meter outside it measures real memory.
        self._fake = False

    # -- tracking -------------------------------------------------------------------------

    def _matches(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self.device.type and (self.device.index is None or d.index == self.device.index)

    def _track_all(self, items: Iterable) -> None:
        for item in items:
            if isinstance(item, torch.Tensor):
                t = _local(item)
                if self._matches(t) and (self._fake or not isinstance(t, FakeTensor)):
                    self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or wrapper subclass: no storage
            return
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None and not torch.UntypedStorage._expired(entry[0].cdata):
            return
        if entry is not None:  # a freed storage's address reused by a new one
            self._total -= entry[1]
        nbytes = st.nbytes()
        self._live[key] = (StorageWeakRef(st), nbytes)
        self._total += nbytes

    def _resized(self, st: torch.UntypedStorage) -> None:
        # Sharding frees and refills parameter memory with storage.resize_, which no op sees.
        if st.device.type != self.device.type or (
            self.device.index is not None and st.device.index != self.device.index
        ):
            return
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            self._total -= entry[1]
        nbytes = st.nbytes()
        self._live[key] = (StorageWeakRef(st), nbytes)
        self._total += nbytes
        self._update_peak()

    def _sweep(self) -> None:
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired, without its two Python calls
        dead = [k for k, (ref, _) in self._live.items() if expired(ref.cdata)]
        for k in dead:
            self._total -= self._live.pop(k)[1]

    def _update_peak(self) -> None:
        # _total over-counts freed storages, so only a total above the peak needs a sweep.
        if self._total <= self.peak_bytes:
            return
        self._sweep()
        if self._total > self.peak_bytes:
            self.peak_bytes = self._total
            self._peak_breakdown = self._categorise()

    def _keys(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        keys = set()
        for item in tensors:
            if isinstance(item, torch.Tensor):
                t = _local(item)
                if self._matches(t):
                    keys.add(t.untyped_storage()._cdata)
        return keys

    def _categorise(self) -> dict[str, int]:
        params, grads, state = set(), set(), set()
        if self.model is not None:
            ps = list(self.model.parameters())
            params = self._keys(ps)
            grads = self._keys(p.grad for p in ps if p.grad is not None)
        if self.optimizer is not None:
            state = self._keys(v for s in self.optimizer.state.values() for v in s.values())
        out = dict.fromkeys(CATEGORIES, 0)
        for key, (_, nbytes) in self._live.items():
            if key in params:
                out["parameters"] += nbytes
            elif key in grads:
                out["gradients"] += nbytes
            elif key in state:
                out["optimizer_state"] += nbytes
            else:
                out["activations_and_other"] += nbytes
        return out

    # -- public ---------------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        """Live bytes of the storages the meter has seen, now (inside or after the region)."""
        self._sweep()
        return self._total

    def reset_peak(self) -> None:
        """Start measuring the peak again from the bytes alive now (inside the region)."""
        self._sweep()
        self.peak_bytes = self._total
        self._peak_breakdown = self._categorise()

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the peak: parameters, gradients, optimizer_state, activations_and_other."""
        return dict(self._peak_breakdown)

    def __enter__(self) -> MemoryMeter:
        if self._mode is not None:
            raise RuntimeError("memfit.MemoryMeter is not reentrant; use a new meter per region")
        self.peak_bytes = 0
        self._live.clear()
        self._total = 0
        self._fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        if self.model is not None:
            self._track_all(self.model.parameters())
            self._track_all(self.model.buffers())
            self._track_all(p.grad for p in self.model.parameters() if p.grad is not None)
        if self.optimizer is not None:
            self._track_all(v for s in self.optimizer.state.values() for v in s.values())
        self._update_peak()
        self._allocator = allocator_of(self.device)
        if self._allocator is not None:  # outside the measured region: syncs are fine here
            self._allocator.synchronize(self.device)
            self._allocator.reset_peak_memory_stats(self.device)
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._orig_resize = torch.UntypedStorage.resize_
        meter, orig = self, self._orig_resize

        def resize_(st, size):
            out = orig(st, size)
            meter._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        assert self._mode is not None
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        self._mode.__exit__(*exc)
        self._mode = None
        if self._allocator is not None:
            self._allocator.synchronize(self.device)
            self.allocator_peak_bytes = int(self._allocator.max_memory_allocated(self.device))
            self.allocator_reserved_peak_bytes = int(self._allocator.max_memory_reserved(self.device))

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={v / 2**20:.2f}MiB" for k, v in self.breakdown().items())
        alloc = ""
        if self.allocator_peak_bytes is not None and self.allocator_reserved_peak_bytes is not None:
            alloc = (
                f"; allocator peaks: allocated={self.allocator_peak_bytes / 2**20:.2f}MiB, "
                f"reserved={self.allocator_reserved_peak_bytes / 2**20:.2f}MiB"
            )
        return f"MemoryMeter(device={self.device}, peak={self.peak_bytes / 2**20:.2f}MiB: {parts}{alloc})"


def allocator_of(device: torch.device):
    """The device module whose caching allocator keeps peak statistics for ``device``
    (``torch.cuda`` on CUDA), or None (the CPU, the meta device, no accelerator)."""
    if HOOKS.allocator is not None:  # tests: a stand-in (See [Note: Instrumentation switches])
        return HOOKS.allocator
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    needed = ("is_available", "synchronize", "reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved")
    if module is None or not all(hasattr(module, f) for f in needed) or not module.is_available():
        return None
    return module


def _default_device(model: nn.Module | None) -> torch.device:
    """The device ``model`` computes on: its first parameter's, or for a sharded model its
    full parameters' (the compute device, even when the shards live in host memory)."""
    from memfit._shard._param import shard_of  # memory.py is imported before sharding

    first = next(model.parameters(), None) if model is not None else None
    if first is None:
        return torch.device("cpu")
    sp = shard_of(first)
    return sp.full.device if sp is not None else first.device
