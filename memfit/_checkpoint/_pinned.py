"""What offload's copies between a device and host memory go through: the side stream and its
events (traced), the pool of pinned host buffers, and the counters of both."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from memfit._instrument import HOOKS

# [Note: Pinned host buffers]
# Offload's host buffers come from a pool per device, not from torch's host caching allocator,
# which rounds every pinned allocation up to a power of two (a 2.1 GB activation takes 4 GB of
# page-locked memory) and keeps it for the life of the process.
# - Size: a buffer holds a copy's bytes rounded up to ALIGN (512). On CUDA it is ordinary host
#   memory page-locked with cudaHostRegister (on whole pages of its own, as a page shared with
#   another allocation could not be locked twice: under two pages more than the buffer), and
#   unlocked with cudaHostUnregister when the pool lets it go. If CUDA refuses (no support, no
#   lockable memory left), the pool falls back to torch's `pin_memory=True` from then on.
#   Without an accelerator with streams nothing is pinned.
# - Reuse: a buffer goes back to the pool when nothing can copy it again (host offload: its
#   entry died; disk: the file is written or the copy back issued), and a later copy of the
#   same size class takes it: a training step that offloads the shapes of the step before
#   allocates nothing. A buffer is read and written only by copies queued on the side stream,
#   so a copy into a reused buffer runs after the copies that used it before, without an event.
#   The host touches a buffer (disk offload's file I/O) only after waiting for an event the side
#   stream recorded after taking it, and queues the next copy after it is done. The trace notes
#   a buffer taken as allocated on "side", given back as freed on "side", and the host's file
#   I/O as a use on "host", so `Trace.violations()` flags any use not ordered that way.
# - Size of the pool: when no buffer is in use (a backward has let every copy go), the pool
#   keeps the most bytes it has had in use at once (what one step offloads) and releases the
#   least recently used free buffers above that: a step with other shapes than the one before
#   leaves the pool at its own size, if it is the larger. That happens inside backward, so the
#   host does not wait there for the side stream's copies (one may still read a buffer): the
#   buffers to release go aside with an event the side stream records, and are released
#   (unlocked, their pages freed) once it has happened, as a later take or give of the pool
#   finds by querying it (no host wait); a pool that is collected waits for them.
# - Exact sizes are reused only by copies of the same size class: shapes that change every step
#   (unbucketed sequence lengths) allocate and release buffers every step. Disk offload's
#   staging takes the smallest free buffer that holds its bytes.
# `OffloadStats.pinned_bytes` is a gauge (what the pools hold now: `reset()` keeps it) and
# `pinned_peak` the most held at once since the last `reset()`.

ALIGN = 512  # bytes: every pinned buffer's size is a multiple of this
PAGE = mmap.PAGESIZE  # cudaHostRegister locks whole pages


@dataclass
class OffloadStats:
    """Counters of offload in this process (tests); ``reset()`` zeroes them, except the gauge
    ``pinned_bytes`` (``pinned_peak`` restarts from it)."""

    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    prefetched: int = 0  # copies back issued before their group's first use
    on_demand: int = 0  # copies back issued at their group's first use
    shared: int = 0  # saves that reused an earlier copy
    from_stash: int = 0  # unpacks served by a source still on the device
    kept: int = 0  # saves left in place (parameters, small, not on a device)
    recast: int = 0  # casts of parameters, made again from the parameter in backward
    pinned_new: int = 0  # host buffers the pools allocated
    pinned_reused: int = 0  # host buffers taken from a pool again
    pinned_bytes: int = 0  # gauge: bytes of host buffers the pools hold now (in use and free)
    pinned_peak: int = 0  # the most bytes the pools held at once since reset()

    def reset(self) -> None:
        for f in fields(self):
            if f.name != "pinned_bytes":
                setattr(self, f.name, 0)
        self.pinned_peak = self.pinned_bytes


STATS = OffloadStats()  # process-wide: counts every offloading block of the process


class _HostDone:
    """An event of the host's: what the host did before it is done, and any copy queued after
    it comes after it, so a stream waits for nothing."""


class Streams:
    """Compute (the current stream), one side stream for copies, and the host, which waits for
    the side stream's events; no-ops on the CPU (traced)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # A device module without streams (MPS) copies on its one queue, in order, unpinned.
        self.accel = device.type != "cpu" and hasattr(torch.get_device_module(device.type), "Stream")
        if self.accel:  # pragma: no cover (needs an accelerator)
            self.mod = torch.get_device_module(device.type)
            self.side = self.mod.Stream(device)

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        if self.accel:  # pragma: no cover (needs an accelerator)
            with self.mod.stream(self.side):
                yield
        else:
            yield

    def _stream(self, name: str):  # pragma: no cover (needs an accelerator)
        return self.side if name == "side" else self.mod.current_stream(self.device)

    def record(self, stream: str):
        # a new object on the CPU: unique in a shared trace
        event = self._stream(stream).record_event() if self.accel and stream != "host" else _HostDone()
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("record", stream, event))
        return event

    def wait(self, stream: str, event) -> None:
        """``stream`` waits for ``event``; the host ("host") blocks until it has happened."""
        if self.accel and not isinstance(event, _HostDone):  # pragma: no cover (needs an accelerator)
            if stream == "host":
                event.synchronize()
            else:
                self._stream(stream).wait_event(event)
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("wait", stream, event))

    def after(self, waiter: str, recorder: str) -> None:
        self.wait(waiter, self.record(recorder))

    @staticmethod
    def note(kind: str, buffer: str, stream: str) -> None:
        if HOOKS.trace is not None:
            HOOKS.trace.log.append((kind, buffer, stream))


class PinnedPool:
    """One device's host buffers for copies, reused by size (See [Note: Pinned host buffers])."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.free: dict[int, list[tuple[int, torch.Tensor]]] = {}  # size -> (when given back, buffer), oldest first
        self.locked: set[int] = set()  # addresses page-locked with cudaHostRegister
        self.in_use = 0  # bytes of the buffers taken and not given back
        self.held = 0  # bytes of every buffer: in use and free
        self.most = 0  # the most bytes in use at once so far: what an idle pool keeps
        self.clock = itertools.count()
        self.register = streams.accel and streams.device.type == "cuda"  # False once CUDA refused
        self.retiring: list[tuple[object, list[torch.Tensor]]] = []  # (side event, buffers to release after it)
        weakref.finalize(self, _release_all, streams, self.free, self.locked, self.retiring).atexit = False

    def take(self, nbytes: int, name: str, at_least: bool = False) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` rounded up to ALIGN (``at_least``: or the smallest free
        one that holds them), noted as ``name`` allocated on the side stream."""
        size = -(-nbytes // ALIGN) * ALIGN
        if self.retiring:
            self._reap()
        if at_least:
            size = min((s for s, bufs in self.free.items() if s >= size and bufs), default=size)
        bufs = self.free.get(size)
        if bufs:
            raw = bufs.pop()[1]
            STATS.pinned_reused += 1
        else:
            raw = self._new(size)
            self.held += size
            STATS.pinned_new += 1
            STATS.pinned_bytes += size
            STATS.pinned_peak = max(STATS.pinned_peak, STATS.pinned_bytes)
        self.in_use += size
        self.most = max(self.most, self.in_use)
        self.streams.note("alloc", name, "side")
        return raw

    def give(self, raw: torch.Tensor, name: str) -> None:
        """``raw`` (from ``take``) is free once the copies queued on the side stream are done."""
        self.streams.note("free", name, "side")
        self.free.setdefault(raw.numel(), []).append((next(self.clock), raw))
        self.in_use -= raw.numel()
        if self.in_use == 0 and self.held > self.most:
            old = sorted((when, size) for size, bufs in self.free.items() for when, _ in bufs)
            drop = []
            for _, size in old:
                if self.held <= self.most:
                    break
                drop.append(self.free[size].pop(0)[1])  # a size's buffers are in the order given back
                self.held -= size
            if drop:  # released once the side stream's copies are done, without a host wait
                self.retiring.append((self.streams.record("side"), drop))
        if self.retiring:
            self._reap()

    def _reap(self) -> None:
        """Release the retiring buffers whose side stream event has happened (queried: no wait)."""
        keep = []
        for event, raws in self.retiring:
            if isinstance(event, _HostDone) or event.query():  # type: ignore[attr-defined]
                _release_now(raws, self.locked)
            else:  # pragma: no cover (needs an accelerator)
                keep.append((event, raws))
        self.retiring[:] = keep

    def _new(self, size: int) -> torch.Tensor:
        if not self.streams.accel:
            return torch.empty(size, dtype=torch.uint8)
        if self.register:  # pragma: no cover (needs CUDA)
            raw = _page_locked(size)
            if raw is not None:
                self.locked.add(raw.data_ptr())
                return raw
            self.register = False
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)  # pragma: no cover (needs an accelerator)


def _page_locked(size: int) -> torch.Tensor | None:  # pragma: no cover (needs CUDA)
    """``size`` bytes of host memory page-locked with cudaHostRegister, on whole pages no other
    allocation shares; None if CUDA refuses."""
    lock = -(-size // PAGE) * PAGE
    base = torch.empty(lock + PAGE, dtype=torch.uint8)
    skip = -base.data_ptr() % PAGE
    # cudaHostRegisterPortable (1), as torch's own registrations: pinned for every device's context
    if int(torch.cuda.cudart().cudaHostRegister(base.data_ptr() + skip, lock, 1)) != 0:
        _clear_cuda_error()
        return None
    return base[skip : skip + size]


def _clear_cuda_error() -> None:  # pragma: no cover (needs CUDA)
    """Consume the error a failed cudart call left pending (torch's bindings return it and leave
    it set), which the next kernel launch would otherwise raise as its own."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")  # a launch's check reads and clears the pending error


def _release(streams: Streams, raws: list[torch.Tensor], locked: set[int]) -> None:
    """Let buffers go: after the side stream's copies (the host waits: one may still read them)."""
    if not raws:
        return
    streams.after("host", "side")
    _release_now(raws, locked)


def _release_now(raws: list[torch.Tensor], locked: set[int]) -> None:
    """Let buffers go that no copy reads any more: unlock them, drop them from the gauge."""
    STATS.pinned_bytes -= sum(r.numel() for r in raws)
    for raw in raws:
        if raw.data_ptr() in locked:  # pragma: no cover (needs CUDA)
            locked.discard(raw.data_ptr())
            if int(torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())) != 0:
                _clear_cuda_error()


def _release_all(
    streams: Streams,
    free: dict[int, list[tuple[int, torch.Tensor]]],
    locked: set[int],
    retiring: list[tuple[object, list[torch.Tensor]]],
) -> None:
    """A pool's finalizer (its buffers are all free: every user holds the pool)."""
    raws = [raw for bufs in free.values() for _, raw in bufs] + [raw for _, later in retiring for raw in later]
    _release(streams, raws, locked)
