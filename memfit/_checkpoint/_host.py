"""Offload of saved tensors to host memory: what is kept, what is copied once, and on which
stream each copy runs (a side stream with events on accelerators; no-ops, traced, on the CPU)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections import deque
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from memfit._checkpoint._pinned import STATS, PinnedPool, Streams
from memfit._instrument import HOOKS, Trace, switched

# [Note: Host offload]
# What a block saves for backward goes to host memory, except what would not free anything or
# would cost more to move than to hold. Kept in place (in this order):
#   1. tensors not on the accelerator (on a CPU-only machine "cpu" offload does nothing), and
#      tensors that are not plain strided ones (sparse, conjugate/negative views, subclasses
#      such as DTensor or FakeTensor);
#   2. parameters and views of parameters: `t`, or the base `t._base` it is a view of, is an
#      nn.Parameter or a leaf that requires grad (its owner holds it to accumulate .grad, so
#      it is alive anyway). Linear saves `weight.t()`, a view of the weight: kept;
#   3. tensors smaller than `min_bytes` (1024 by default, torchtune's `min_offload_size`):
#      the copies' fixed costs outweigh the bytes;
#   4. tensors that share storage with a parameter or buffer of the checkpointed module
#      (`weight.detach()`, BatchNorm's running statistics), when the block is a module.
# Neither kept nor moved: a cast of a parameter (autocast's bf16 copy of a Linear's weight, or a
# view of it: what autograd saves is `weight.to(bf16).t()`) is made again from the parameter
# when backward needs it (Recast), as a checkpointed block's forward is recomputed from the
# parameters as they are then. Moving it would cost its bytes twice per step on the link and
# save nothing in forward (autocast's cache holds the cast until the autocast region ends);
# keeping it would hold a second copy of every weight until backward.
# A copy moves the storage region a tensor spans, once, and the tensor comes back as a view of
# it with its own sizes, strides and offset: channels_last stays channels_last, an expanded
# (stride 0) tensor moves its small storage, not its expanded size. A tensor whose region has
# gaps (a strided slice) moves its elements only and comes back dense in the same order.
# A tensor saved several times, or a view of a region already copied (same storage, same
# version, inside the region), shares the first copy: one copy out, one copy back.
#
# A tensor modified in place after it was saved fails in backward with autograd's error, as
# without offload: saved-tensor hooks turn autograd's own version check off, so every handle
# (kept ones too) records the version it was saved at and checks it on unpack (SavedVersion).
#
# Streams (accelerators; see [Note: Streams and buffer lifetimes] in _shard/_streams.py for
# the same rules on sharding's streams):
# - forward: the side stream waits for compute, copies the region into a pinned host buffer
#   (non_blocking) and records an event. The source stays referenced in a bounded stash: at
#   most `stash` tensors (5, as torchtune's), and only from this block and the one before (a
#   block's copies have had the next block's forward to finish; a checkpointed block offloads
#   one input, so a count alone would keep the last 5 blocks' inputs on the device). The
#   compute stream waits for a copy's event only when its source leaves the stash (its memory
#   may then be reused by compute), never the host.
#   A tensor still in the stash when backward needs it is used as it is, not copied back.
# - backward: the first unpack of a block's group fetches what of that group is not on the
#   device yet (only the first block in backward order has any: its first tensors usually
#   come from the stash) and prefetches the group saved just before it in forward (the next
#   block in backward order) on the side stream, so that copy overlaps this block's backward.
#   For a sequential model at most these two groups are on the device at once. Device
#   buffers are allocated on compute (the side stream waits for compute first, as their
#   memory may have been in use there) and compute waits for the fetch's event before the
#   first use or before dropping an unused buffer, so no buffer is reused early and no
#   record_stream is needed.
# - host buffers: a region's copy goes into an exact-size buffer from the device's pool (See
#   [Note: Pinned host buffers]), which takes it back when the entry dies (nothing can fetch
#   it again) for the next copy-out of that size. Every read and write of a host buffer is a
#   copy queued on the side stream (out in forward, back in backward), so a reused buffer's
#   next copy runs after its last one by stream order, with no event and no host wait; the
#   trace notes each buffer allocated, used and freed on "side" only, so a use on another
#   stream would show in `Trace.violations()`.
# Only a real accelerator runs the streams, pinned memory and asynchronous copies. On the
# CPU `host_offload_on_cpu()` (memfit.testing) treats CPU tensors as if they were on a device:
# the same decisions, copies (synchronous) and waits/records, traced, so tests check which
# bytes move and the ordering rules above without a GPU.

MIN_BYTES = 1024  # tensors below this many bytes are kept (torchtune's min_offload_size)
STASH = 5  # forward: sources held until their copy to the host is done (torchtune's max_fwd_stash_size)


@contextlib.contextmanager
def cpu_as_device() -> Iterator[Trace]:
    """Treat CPU tensors as accelerator tensors for "cpu" offload and trace the streams (into
    the trace already on, if one is: sharding's and offload's streams in one log)."""
    _offloaders.clear()
    try:
        with switched(trace=HOOKS.trace or Trace(), cpu_as_device=True) as hooks:
            yield cast(Trace, hooks.trace)
    finally:
        _offloaders.clear()


class _Fetch:
    """One batch of copies back to the device and the event after them."""

    __slots__ = ("event", "waited")

    def __init__(self, event) -> None:
        self.event = event
        self.waited = False  # whether compute has waited for `event`


class _Entry:
    """One storage region copied to the host; on the device again between fetch and last use."""

    __slots__ = (
        "__weakref__",
        "copied",
        "dense",
        "device_buf",
        "dtype",
        "fetch",
        "live",
        "name",
        "off",
        "raw",
        "ref",
        "seq",
        "source",
        "span",
        "stale",
        "start",
        "used",
        "version",
    )

    def __init__(self, off: _HostOffload, t: torch.Tensor, start: int, span: int, dense: bool, seq: int) -> None:
        self.off, self.name, self.seq = off, f"#{next(_names)}", seq  # seq: its group's
        self.start, self.span, self.dense, self.dtype = start, span, dense, t.dtype
        self.version = t._version
        # alive: the storage is too, so its address names it (the base of a view: ops save
        # views they make inside, which nothing holds once saved, of the tensors they were given)
        self.ref = weakref.ref(t if t._base is None else t._base)
        # The device memory, until its copy is done: detached, as `t` may be the output of the
        # op saving it, whose grad_fn holds this entry (a cycle through C++ that would keep the
        # whole graph alive after the user drops it, until the stash let go).
        self.source: torch.Tensor | None = t.detach()
        self.raw: torch.Tensor | None = None  # the host buffer (uint8, from the pool), once copied
        self.copied = None  # the copy-out's event
        self.stale: int | None = None  # the source's version when released, if modified after the save
        self.device_buf: torch.Tensor | None = None
        self.fetch: _Fetch | None = None
        self.live = 0  # saved-tensor handles alive
        self.used: set[int] = set()  # of those, the ones unpacked since the last fetch (ids)

    def __del__(self) -> None:
        if self.raw is not None:  # nothing can copy it back any more
            self.off.pool.give(self.raw, f"host{self.name}")

    def host(self) -> torch.Tensor:
        """The host copy: the region's elements (dense ones: the storage region)."""
        return cast(torch.Tensor, self.raw)[: self.nbytes].view(self.dtype)

    def covers(self, t: torch.Tensor, start: int, span: int) -> bool:
        held = self.ref()
        if held is None:
            held = self.source  # in the stash: its storage is alive
        return (
            self.dense
            and held is not None
            and held._version == self.version == t._version
            and self.start <= start
            and start + span <= self.start + self.span
        )

    @property
    def nbytes(self) -> int:
        return self.span * self.dtype.itemsize


def _modified(t: torch.Tensor | tuple, now: int, saved: int) -> RuntimeError:
    shape, dtype = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
    return RuntimeError(
        "memfit offload: one of the variables needed for gradient computation has been modified "
        f"by an inplace operation: {str(dtype).removeprefix('torch.')}{list(shape)} is at version "
        f"{now}; expected version {saved} instead (autograd raises the same error without "
        "offload). Clone the tensor before modifying it in place."
    )


class SavedVersion:
    """The version a tensor had when it was saved for backward, checked when it is unpacked.

    Behind saved-tensor hooks autograd checks no version counter, so a tensor modified in
    place after it was saved would silently give the gradient of other values (or, on an
    accelerator, race with its copy to the host). Offload raises autograd's error instead.
    The counter is read from the tensor (or the base it views) while it is alive: once nothing
    but the offloaded copy is left, nothing can modify it either. A modification made while the
    stash held the source (when an accelerator's copy may still have been reading it) is seen
    through the source (``stale``); one made after that, before the tensor was dropped, is not
    (backward then uses the values saved).
    """

    __slots__ = ("dtype", "ref", "shape", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t if t._base is None else t._base)  # a view shares its base's counter
        self.version, self.shape, self.dtype = t._version, tuple(t.shape), t.dtype

    def check(self, source: torch.Tensor | None = None, stale: int | None = None) -> None:
        """Raise if the tensor, or ``source`` (an alias on the same counter), was modified, or
        if the copy's source was (``stale``: its version when it was released)."""
        held = self.ref()
        now = held._version if held is not None else source._version if source is not None else self.version
        now = stale if now == self.version and stale is not None else now
        if now != self.version:
            raise _modified((self.shape, self.dtype), now, self.version)


class Kept:
    """A saved tensor left in place, and its version (checked on unpack: see SavedVersion).

    Held detached when it has a grad_fn: the op saving it may be the one that made it, whose
    node would then hold its own output through this object, a cycle through autograd's C++
    graph that keeps the graph alive for ever once the user drops it without a backward.
    (Autograd rebuilds the unpacked tensor's history itself.)
    """

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t if t.grad_fn is None else t.detach(), t._version

    def unpack(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise _modified(self.t, self.t._version, self.version)
        return self.t


class Recast:
    """A cast of a parameter (or a view of one) saved for backward: made again from the
    parameter on unpack (see [Note: Host offload]). The parameter must not have been modified
    in place since the save (the error autograd gives for a saved parameter), nor the cast."""

    __slots__ = ("dtype", "offset", "param", "param_version", "size", "stride", "version")

    def __init__(self, t: torch.Tensor, param: torch.Tensor) -> None:
        self.param, self.param_version, self.dtype = param, param._version, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = SavedVersion(t)

    def unpack(self) -> torch.Tensor:
        self.version.check()
        if self.param._version != self.param_version:
            p = self.param
            raise RuntimeError(
                f"memfit offload: a parameter {str(p.dtype).removeprefix('torch.')}{list(p.shape)} was modified in "
                f"place between forward and backward (version {self.param_version} -> {p._version}), and this "
                f"block's backward needs its {str(self.dtype).removeprefix('torch.')} cast (autocast's): offload "
                "makes casts of parameters again from the parameter in backward instead of keeping them, so it "
                "would see the new values. Modify parameters after backward, or run this block without offload."
            )
        with torch.no_grad():
            cast = self.param.detach().to(self.dtype)
        return cast.as_strided(self.size, self.stride, self.offset)


def recast(t: torch.Tensor) -> Recast | None:
    """``t``'s handle if it is a cast of a parameter (counted), else None."""
    param = cast_of_parameter(t)
    if param is None:
        return None
    STATS.recast += 1
    return Recast(t, param)


def cast_of_parameter(t: torch.Tensor) -> torch.Tensor | None:
    """The parameter ``t`` is a same-layout cast of (or a view of one), else None: the cast's
    node is a ``_to_copy`` whose only input is the parameter's gradient accumulator."""
    base = t if t._base is None else t._base
    if base.dtype != t.dtype:  # a view as another dtype (view_as_real, .view(dtype)): moved as it is
        return None
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0" or len(node.next_functions) != 1:
        return None
    param = getattr(node.next_functions[0][0], "variable", None)
    if param is None or param.device != t.device or base.storage_offset() != 0:
        return None
    if param.shape != base.shape or param.stride() != base.stride():
        return None
    return param


class _Saved:
    """What autograd holds for one offloaded saved tensor."""

    __slots__ = ("entry", "group", "offset", "size", "stride", "version")

    def __init__(self, entry: _Entry, group: _Group, t: torch.Tensor) -> None:
        self.entry, self.group = entry, group
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = SavedVersion(t)
        entry.live += 1

    def __del__(self) -> None:
        entry = self.entry
        entry.live -= 1
        entry.used.discard(id(self))
        if len(entry.used) >= entry.live:
            entry.off.done(entry)


class _Group:
    """The tensors one block call offloaded to one device: fetched together in backward."""

    __slots__ = ("__weakref__", "entries", "prefetched", "seq")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.entries: list[_Entry] = []
        self.prefetched = False  # whether its first unpack has prefetched the group before it


def _region(t: torch.Tensor) -> tuple[int, int]:
    """(first element, number of elements) of the storage region ``t`` spans."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
    return cast(int, t.storage_offset()), span


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


def parameter_or_view(t: torch.Tensor) -> bool:
    """Rule 2 of [Note: Host offload]: ``t`` or the base it views is a parameter or a leaf
    that requires grad (alive anyway)."""
    return _is_param(t) or (t._base is not None and _is_param(t._base))


@functools.cache
def _accelerator() -> str | None:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else None


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the accelerator (or on the CPU under `cpu_as_device`): offload moves it
    through the side stream and pinned host buffers."""
    return t.device.type == _accelerator() or (HOOKS.cpu_as_device and t.device.type == "cpu")


def offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    """Rules 1-3 of [Note: Host offload] (rule 4 needs the module: `_HostHooks`)."""
    if not on_device(t) or type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided:
        return False
    if t.is_conj() or t.is_neg() or parameter_or_view(t):
        return False
    if t.numel() == 0:
        return False
    # The bytes a copy would move: the storage region the tensor spans (an expanded tensor's is small).
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size() >= min_bytes


class _HostOffload:
    """Host offload of one device: its streams, forward stash, index of copies and groups."""

    def __init__(self, device: torch.device) -> None:
        self.streams = Streams(device)
        self.pool = PinnedPool(self.streams)  # the host buffers of this device's copies (disk offload's too)
        self.device = device
        self.stash: deque[_Entry] = deque()  # the entries whose source is held, oldest first
        self.index: dict[tuple, weakref.ref] = {}  # (storage address, dtype) -> newest entry
        self.groups: list[weakref.ref] = []  # in forward order
        self.seq = itertools.count()

    def new_group(self) -> _Group:
        group = _Group(next(self.seq))
        for entry in list(self.stash):  # copies of blocks before the previous one are done by now
            if entry.seq < group.seq - 1:
                self.release_source(entry)
        if len(self.groups) > 64:
            self.groups = [g for g in self.groups if g() is not None]
        self.groups.append(weakref.ref(group))
        return group

    # -- forward -------------------------------------------------------------------------

    def pack(self, group: _Group, t: torch.Tensor, stash: int) -> _Saved:
        start, span = _region(t)
        dense = span <= t.numel()
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if len(self.index) > 4096:
            self.index = {k: r for k, r in self.index.items() if r() is not None}
        found = self.index.get(key)
        entry = found() if found is not None else None
        if entry is not None and entry.covers(t, start, span):
            STATS.shared += 1
        else:
            entry = self._copy_out(t, start, span, dense, stash, group.seq)
            group.entries.append(entry)
            if dense:
                self.index[key] = weakref.ref(entry)
        return _Saved(entry, group, t)

    def _copy_out(self, t: torch.Tensor, start: int, span: int, dense: bool, stash: int, seq: int) -> _Entry:
        entry = _Entry(self, t, start, span if dense else t.numel(), dense, seq)
        s = self.streams
        s.note("alloc", f"src{entry.name}", "compute")
        entry.raw = self.pool.take(entry.nbytes, f"host{entry.name}")  # See [Note: Pinned host buffers]
        host = entry.host()
        s.after("side", "compute")  # t was written on compute
        with s.on_side():
            region = t.as_strided((span,), (1,), start) if dense else t
            (host if dense else host.view(t.size())).copy_(region, non_blocking=True)
            s.note("use", f"src{entry.name}", "side")
            s.note("use", f"host{entry.name}", "side")
            entry.copied = s.record("side")
        STATS.d2h_copies += 1
        STATS.d2h_bytes += entry.nbytes
        self.stash.append(entry)
        self._trim(stash)
        return entry

    def _trim(self, stash: int) -> None:
        while len(self.stash) > stash:
            self.release_source(self.stash[0])

    def release_source(self, entry: _Entry) -> None:
        """Drop the device source: compute waits for its copy first (its memory may be reused)."""
        if entry.source is not None:
            if entry.source._version != entry.version:  # modified while its copy may have run
                entry.stale = entry.source._version
            self.streams.wait("compute", entry.copied)
            entry.source = None
            self.streams.note("free", f"src{entry.name}", "compute")
            self.stash.remove(entry)

    # -- backward ------------------------------------------------------------------------

    def unpack(self, saved: _Saved) -> torch.Tensor:
        entry, group = saved.entry, saved.group
        src = entry.source
        saved.version.check(src, entry.stale)
        if src is not None and src._version != entry.version:  # (a tensor on another counter)
            self.release_source(entry)  # the host copy holds the values saved
            src = None
        if src is not None:
            STATS.from_stash += 1
            out = src.as_strided(saved.size, saved.stride, saved.offset)
            self._prefetch_once(group)
        else:
            if entry.device_buf is None:  # on demand: the first group in backward order
                self._fetch([entry, *group.entries], prefetch=False)
            self._prefetch_once(group)
            fetch, buf = cast(_Fetch, entry.fetch), cast(torch.Tensor, entry.device_buf)  # _fetch set both
            if not fetch.waited:
                self.streams.wait("compute", fetch.event)
                fetch.waited = True
            if entry.dense:
                out = buf.as_strided(saved.size, saved.stride, saved.offset - entry.start)
            else:
                out = buf.view(saved.size)
            self.streams.note("use", f"dev{entry.name}", "compute")
        entry.used.add(id(saved))
        if len(entry.used) >= entry.live:
            self.done(entry)
        return out

    def _prefetch_once(self, group: _Group) -> None:
        """At a group's first unpack: copy back the rest of the group (its first tensors may
        come from the stash) and the group saved before it (next in backward order)."""
        if not group.prefetched:
            group.prefetched = True
            self._fetch(group.entries, prefetch=True)
            before = self._group_before(group)
            if before is not None:
                self._fetch(before.entries, prefetch=True)

    def _group_before(self, group: _Group) -> _Group | None:
        for ref in reversed(self.groups):
            g = ref()
            if g is not None and g.seq < group.seq and g.entries:
                return g
        return None

    def _fetch(self, entries: list[_Entry], prefetch: bool) -> None:
        todo = list({id(e): e for e in entries if e.live and e.device_buf is None and e.source is None}.values())
        if not todo:
            return
        s = self.streams
        bufs = [torch.empty(e.span, dtype=e.dtype, device=self.device) for e in todo]  # on compute
        for e in todo:
            s.note("alloc", f"dev{e.name}", "compute")
        s.after("side", "compute")  # the buffers' memory may have been in use on compute
        with s.on_side():
            for e, buf in zip(todo, bufs):
                buf.copy_(e.host(), non_blocking=True)  # packed to the host before
                s.note("use", f"host{e.name}", "side")
                s.note("use", f"dev{e.name}", "side")
            fetch = _Fetch(s.record("side"))
        for e, buf in zip(todo, bufs):
            e.device_buf, e.fetch = buf, fetch
            e.used.clear()
            STATS.h2d_bytes += e.nbytes
        STATS.h2d_copies += len(todo)
        if prefetch:
            STATS.prefetched += len(todo)
        else:
            STATS.on_demand += len(todo)

    def done(self, entry: _Entry) -> None:
        """Every live handle of ``entry`` has its tensor: drop the device copy and the source
        (the unpacked tensors keep their memory as long as autograd needs them)."""
        if entry.device_buf is not None:
            fetch = cast(_Fetch, entry.fetch)  # set with device_buf
            if not fetch.waited:  # fetched but never used: compute must not reuse it early
                self.streams.wait("compute", fetch.event)
                fetch.waited = True
            entry.device_buf = None
            self.streams.note("free", f"dev{entry.name}", "compute")
        entry.used.clear()
        if entry.live == 0:
            self.release_source(entry)


_offloaders: dict[torch.device, _HostOffload] = {}  # process-wide: one side stream per device for every block
_names = itertools.count()  # process-wide: entries' names are unique in a trace


def buffer_name(kind: str) -> str:
    """A name for a buffer in the trace, unique in the process."""
    return f"{kind}#{next(_names)}"


def offloader(device: torch.device) -> _HostOffload:
    """The offloader of ``device``: its side stream and pinned buffer pool (disk offload's too)."""
    off = _offloaders.get(device)
    if off is None:
        off = _offloaders[device] = _HostOffload(device)
    return off


class HostHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks of one block call that offload to host memory (a group per device)."""

    def __init__(self, min_bytes: int, stash: int, module: nn.Module | None) -> None:
        self.min_bytes, self.stash, self.module = min_bytes, stash, module
        self.groups: dict[torch.device, _Group] = {}
        self.module_storages: set[int] | None = None
        super().__init__(self.pack, _unpack)

    def __exit__(self, *args) -> None:
        # The bound pack hook makes this object a cycle, freed only by the garbage collector:
        # the groups must not wait for it (their host buffers go back to the pool with them).
        self.groups = {}
        super().__exit__(*args)

    def _module_state(self, t: torch.Tensor) -> bool:
        if self.module is None:
            return False
        if self.module_storages is None:
            tensors = itertools.chain(self.module.parameters(), self.module.buffers())
            self.module_storages = {p.untyped_storage().data_ptr() for p in tensors} - {0}
        return t.untyped_storage().data_ptr() in self.module_storages

    def pack(self, t: torch.Tensor):
        if not offloadable(t, self.min_bytes) or self._module_state(t):
            STATS.kept += 1
            return Kept(t)
        if (handle := recast(t)) is not None:
            return handle
        off = offloader(t.device)
        group = self.groups.get(t.device)
        if group is None:
            group = self.groups[t.device] = off.new_group()
        return off.pack(group, t, self.stash)


def _unpack(packed):
    if isinstance(packed, _Saved):
        return packed.entry.off.unpack(packed)
    return packed.unpack()
