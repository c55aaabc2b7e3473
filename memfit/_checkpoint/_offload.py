"""Where saved tensors wait for backward: in place, in host memory, or on disk."""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import nn

from memfit._checkpoint._host import (
    MIN_BYTES,
    STASH,
    HostHooks,
    Kept,
    SavedVersion,
    buffer_name,
    offloader,
    on_device,
    parameter_or_view,
    recast,
)
from memfit._instrument import HOOKS

# [Note: Offload of saved tensors]
# Offload applies saved-tensor hooks to the tensors a block keeps for backward: the inputs of
# a checkpointed block, or everything a block saves when it is not recomputed (save="all").
# Parameters, leaves that require grad, and views of either are never offloaded (they stay
# alive anyway, so moving them would save nothing): Linear saves `weight.t()`, which stays.
#   "cpu":  accelerator tensors go to pinned host memory on a side stream in forward and come
#           back in backward, a block's tensors prefetched while the block after it (in
#           forward order) runs its backward; see [Note: Host offload] in _host.py for what is
#           kept (parameters, tensors under `min_bytes`, module state), strides, tensors
#           saved twice, the bounded stash and the streams. Tensors already on the CPU are
#           kept as they are: on a CPU-only machine "cpu" offload does no work.
#   "disk": every tensor is written to its own file in a private temporary directory (under
#           `Offload.directory`, default the system temp dir) and read back, memory-mapped,
#           on unpack. A file is deleted as soon as autograd drops the saved tensor; the
#           directory is removed at exit. Works on the CPU: peak memory falls by the bytes
#           offloaded, and values come back bitwise.
#           An accelerator's tensor goes through a pinned staging buffer of host offload's
#           pool, with its streams (See [Note: Pinned host buffers]): on pack the side stream
#           waits for compute and copies the tensor into the buffer (non_blocking), and the
#           host waits for that copy's event only (not for the device) before writing the
#           file; on unpack the host waits for the side stream's earlier copies (the buffer
#           may be a reused one), reads the file into the buffer, and the side stream copies
#           it to a new device tensor (non_blocking) whose event compute waits for before
#           autograd uses it. The file I/O blocks the host, as before; the device does not
#           wait for it.

TARGETS = ("cpu", "disk")


@dataclass(frozen=True)
class Offload:
    """Where the tensors a block keeps for backward wait.

    Attributes:
        target: ``"cpu"`` (pinned host memory; no-op for tensors already on the CPU) or
            ``"disk"`` (memory-mapped files in a private temporary directory).
        directory: for ``"disk"``: the parent of that temporary directory (default: the
            system's temporary directory). Checked for writing when the policy is built, so
            a bad directory fails before any forward, leaving nothing behind.
        min_bytes: tensors smaller than this stay where they are (default: 1024 for
            ``"cpu"``, as torchtune's ``OffloadActivations``; 0 for ``"disk"``).
        stash: for ``"cpu"``: how many offloaded tensors forward keeps on the device until
            their copy to the host is done (default 5, as torchtune; only from the current
            and the previous block); the compute stream waits for a copy only when its
            tensor leaves the stash.
    """

    target: str
    directory: str | None = None
    min_bytes: int | None = None
    stash: int = STASH

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"memfit: unknown offload target {self.target!r}; choose None or one of {TARGETS}")
        if self.directory is not None and self.target != "disk":
            raise ValueError(f"memfit.Offload: directory applies to target='disk' only, not {self.target!r}")
        if self.min_bytes is None:
            object.__setattr__(self, "min_bytes", MIN_BYTES if self.target == "cpu" else 0)
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"memfit.Offload: min_bytes must be an integer >= 0, got {self.min_bytes!r}")
        if not isinstance(self.stash, int) or self.stash < 1:
            raise ValueError(f"memfit.Offload: stash must be an integer >= 1, got {self.stash!r}")
        if self.target == "disk":
            _probe_writable(self.directory or tempfile.gettempdir())


def _probe_writable(directory: str) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix="memfit-probe-", dir=directory))
    except OSError as e:
        raise ValueError(
            f"memfit offload: cannot write to {directory!r} ({e.strerror or e}); pass "
            "memfit.Offload('disk', directory=...) with a writable directory"
        ) from None


def resolve_offload(offload: str | Offload | None) -> Offload | None:
    """Validate an ``offload`` argument: None, "cpu", "disk" or an :class:`Offload`."""
    if offload is None or isinstance(offload, Offload):
        return offload
    if isinstance(offload, str) and offload in TARGETS:
        return _from_name(offload)
    raise ValueError(f"memfit: unknown offload target {offload!r}; choose None or one of {TARGETS}")


@functools.cache
def _from_name(target: str) -> Offload:
    return Offload(target)  # built once: "disk" probes the temporary directory


def offload_hooks(offload: Offload | None, module: nn.Module | None = None) -> contextlib.AbstractContextManager:
    """A context under which saved tensors go to the ``offload`` target (None: stay in place).
    Enter a new one per block call: for "cpu" it is the group fetched together in backward.
    ``module``: the checkpointed module, if the block is one (its state is never offloaded)."""
    if offload is None:
        return contextlib.nullcontext()
    min_bytes = cast(int, offload.min_bytes)  # Offload.__post_init__ fills it
    if offload.target == "cpu":
        return HostHooks(min_bytes, offload.stash, module)
    store = _DiskStore.for_directory(offload.directory or tempfile.gettempdir())
    return torch.autograd.graph.saved_tensors_hooks(functools.partial(store.pack, min_bytes), _unpack_disk)


def _keep(t: torch.Tensor) -> bool:
    """Parameters and views of parameters (rule 2 of [Note: Host offload])."""
    return parameter_or_view(t)


# -- disk ----------------------------------------------------------------------------------


class _OnDisk:
    """A saved tensor written to ``path``; the file goes when this object does."""

    __slots__ = ("__weakref__", "device", "dtype", "nbytes", "path", "shape", "staged", "stride", "version")

    def __init__(self, t: torch.Tensor, path: str) -> None:
        self.path = path
        self.version = SavedVersion(t)
        self.shape, self.stride = t.shape, t.stride()
        self.dtype, self.device = t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.staged = _staged(t)  # comes back through a pinned buffer and the side stream
        weakref.finalize(self, _remove, path)

    def load(self) -> torch.Tensor:
        self.version.check()
        if self.staged:
            return self._to_device()
        raw = torch.from_file(self.path, shared=False, size=self.nbytes, dtype=torch.uint8)
        t = raw.view(self.dtype).reshape(self.shape)
        if t.stride() != self.stride:
            t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype).copy_(t)
        return t.to(self.device)

    def _to_device(self) -> torch.Tensor:
        """The file through a pinned buffer, copied on the side stream; compute waits for it."""
        off = offloader(self.device)
        s, name, dev = off.streams, buffer_name("stage"), buffer_name("dev")
        raw = off.pool.take(self.nbytes, name, at_least=True)
        try:
            s.after("host", "side")  # a reused buffer: the copies that read it are done
            host = raw[: self.nbytes]
            with open(self.path, "rb") as f:
                got = f.readinto(memoryview(host.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer
            if got != self.nbytes:
                raise OSError(
                    errno.EIO,
                    f"memfit offload: {self.path} holds {got} of the {self.nbytes} bytes written for a saved "
                    "tensor: something truncated it. Leave the offload directory alone while training.",
                )
            s.note("use", name, "host")
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)  # on compute
            s.note("alloc", dev, "compute")
            s.after("side", "compute")  # its memory may have been in use on compute
            s.after("side", "host")  # the buffer is filled
            with s.on_side():
                out.copy_(host.view(self.dtype).view(self.shape), non_blocking=s.accel)
                s.note("use", name, "side")
                s.note("use", dev, "side")
                copied = s.record("side")
            s.wait("compute", copied)
            s.note("use", dev, "compute")  # autograd's, from here on
        finally:
            off.pool.give(raw, name)
        return out


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write(path: str, t: torch.Tensor) -> None:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    with open(path, "wb") as f:
        f.write(memoryview(data))  # type: ignore[arg-type]  # an ndarray is a buffer


def _staged(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to disk through a pinned buffer: a plain tensor on the accelerator."""
    return on_device(t) and type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided


@contextlib.contextmanager
def _on_host(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` where the host can write it out: itself, or for a tensor on the accelerator a
    pinned staging buffer it is copied into on the side stream, the host waiting for that copy
    only (See [Note: Offload of saved tensors])."""
    if not _staged(t):
        yield t
        return
    off = offloader(t.device)
    s, name, nbytes = off.streams, buffer_name("stage"), t.numel() * t.element_size()
    raw = off.pool.take(nbytes, name, at_least=True)
    try:
        host = raw[:nbytes].view(t.dtype).view(t.shape)
        s.after("side", "compute")  # t was written on compute
        with s.on_side():
            host.copy_(t.detach(), non_blocking=s.accel)
            s.note("use", name, "side")
        s.after("host", "side")
        s.note("use", name, "host")
        yield host
    finally:
        s.after("side", "host")  # written out: the buffer's next copy comes after
        off.pool.give(raw, name)


class _DiskStore:
    """One private temporary directory per parent directory, removed at exit."""

    _stores: ClassVar[dict[str, _DiskStore]] = {}

    def __init__(self, parent: str) -> None:
        self.parent = parent
        self.dir: str | None = None
        self.names = itertools.count()

    @classmethod
    def for_directory(cls, parent: str) -> _DiskStore:
        parent = os.path.abspath(parent)
        if parent not in cls._stores:
            cls._stores[parent] = cls(parent)
        return cls._stores[parent]

    def _directory(self) -> str:
        if self.dir is None or not os.path.isdir(self.dir):
            self.dir = tempfile.mkdtemp(prefix="memfit-offload-", dir=self.parent)
            atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        return self.dir

    def pack(self, min_bytes: int, t: torch.Tensor):
        if _keep(t) or t.numel() == 0 or t.numel() * t.element_size() < min_bytes:
            return Kept(t)
        if (handle := recast(t)) is not None:  # made again in backward (see [Note: Host offload])
            return handle
        path = os.path.join(self._directory(), f"{next(self.names)}.bin")
        try:
            with _on_host(t) as host:
                if HOOKS.offload_write is not None:  # tests: fault injection
                    HOOKS.offload_write(path, host, _write)
                else:
                    _write(path, host)
        except OSError as e:
            _remove(path)
            raise OSError(
                e.errno or errno.EIO,
                f"memfit offload: writing a saved tensor ({t.numel() * t.element_size()} bytes) to {path} "
                f"failed: {e.strerror or e}. Free space there, or offload elsewhere with "
                "memfit.Offload('disk', directory=...). Parameters and gradients were not changed.",
            ) from e
        return _OnDisk(t, path)


def _unpack_disk(packed):
    return packed.load() if isinstance(packed, _OnDisk) else packed.unpack()
