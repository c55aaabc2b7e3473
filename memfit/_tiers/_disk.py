"""The disk tier: tensors that live in files on a local disk, read ahead of use and written
back behind it (See [Note: The disk tier])."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import shutil
import tempfile
import time
import weakref
from typing import cast

import torch

__all__ = ["DiskFile", "check_room", "measured_bandwidth", "padded", "read_ahead"]

# [Note: The disk tier]
# A DiskFile maps one file on a local disk (MAP_SHARED: torch's UntypedStorage.from_file) and
# hands out tensors that are views of the mapping: what a unit keeps on disk (its parameter
# shards, its gradients, then its optimizer state) is those tensors, so every op on them (the
# gather's copy-in, the optimizer step, a checkpoint's read and its load) is the same
# arithmetic as on host memory, only the storage differs: bitwise the host tier's results.
# - Reads ahead: `prefetch()` asks the kernel to read the file in the background
#   (MADV_WILLNEED), issued for the units the next forward or backward reaches next; a page
#   not read yet is read when touched (correct, only slower).
# - Writes behind: `release()` after a unit's step writes the dirty pages back (msync), then
#   drops them from this process (MADV_DONTNEED) and from the page cache (POSIX_FADV_DONTNEED),
#   so that what stays resident is bounded by the units between a prefetch and a release, not
#   by the model.
# - Scratch: the file is unlinked as soon as it is mapped, so a killed process leaves nothing
#   on the disk and nothing reads it again; a resume reads checkpoints only (memfit.
#   load_checkpoint writes into these tensors in place, or the optimizer's new state moves in
#   at its next step).
# - A disk without room for the whole tier is refused before anything is written
#   (`check_room`), naming the path and the bytes; and each file is reserved when made
#   (posix_fallocate), so that a disk filled meanwhile by someone else fails there, with an
#   error, not at a page fault in the middle of a step (a write to an unbacked page of a
#   sparse file on a full disk is a SIGBUS).
# - Closed deterministically: `close()` closes the file's descriptor (the tier's owner calls it
#   when it is released: HostStep.close); a weakref.finalize closes it at the latest when the
#   DiskFile is collected. The mapping itself lives as long as the tensors that view it (each
#   holds the mapping), so closing never pulls memory from under a tensor still in use.
# - Read-ahead depth from the disk's speed: `measured_bandwidth` reads and writes a short file
#   on the disk once per directory (cached), and `read_ahead` keeps about READ_AHEAD_S seconds of
#   that disk's reads in flight, in units, at least one, bounded by READ_AHEAD_BYTES.
# Only on Linux (and other POSIX systems with madvise); the mapping's alignment is the page.


class DiskFile:
    """One file of the disk tier, mapped; :meth:`tensor` gives views of it."""

    def __init__(self, directory: str, nbytes: int, what: str) -> None:
        self.what = what  # named in errors
        self.nbytes = max(int(nbytes), 1)
        fd, self.path = tempfile.mkstemp(prefix="memfit-tier-", suffix=".bin", dir=directory)
        try:
            _reserve(fd, self.nbytes, self.path, what)
            # torch's own shared mapping (MAP_SHARED): it holds no descriptor, and lives as long
            # as the tensors that view it (See [Note: The disk tier])
            storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(self.path, True, self.nbytes))
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(self.path)  # See [Note: The disk tier]: scratch, gone with the process
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)  # the backstop of close()
        self._storage: torch.UntypedStorage | None = storage
        self._base = storage.data_ptr()  # the mapping's first page
        self._used = 0
        self.written = 0  # bytes written back by release(dirty=True) (tests and the planner's check read these)
        self.dropped = 0  # bytes dropped from memory by release: read again at their next use

    def tensor(self, like: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """A new tensor in the file, shaped and typed as ``like``, holding ``like``'s values
        (``copy``; else the file's: zeros in a new file)."""
        nbytes = like.numel() * like.element_size()
        start = -(-self._used // 64) * 64  # 64-byte aligned, as the CPU kernels' vector loads like it
        if start + nbytes > self.nbytes or self._storage is None:
            raise RuntimeError(
                f"memfit disk tier: {self.what} needs {start + nbytes} bytes of its file {self.path}, "
                f"sized {self.nbytes} (closed: {self.closed}); this is a bug in memfit, please report it"
            )
        self._used = start + nbytes
        if like.numel() == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        flat = torch.empty(0, dtype=like.dtype).set_(self._storage, start // like.element_size(), (like.numel(),), (1,))
        out = flat.view(like.shape)
        if copy:
            out.copy_(like)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is in this file."""
        if t.numel() == 0:
            return True
        return self._base <= t.untyped_storage().data_ptr() < self._base + self.nbytes

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def close(self) -> None:
        """Close the file's descriptor (idempotent); its tensors keep the mapping while they live."""
        self._close()
        self._storage = None

    def prefetch(self) -> None:
        """Read the file ahead of use, in the background (See [Note: The disk tier])."""
        if self._storage is not None:
            _madvise(self._base, self.nbytes, _MADV_WILLNEED)

    def release(self, dirty: bool) -> None:
        """Write back (``dirty``) and drop the file's pages from memory."""
        if self._storage is None:
            return
        if dirty:
            if _LIBC.msync(ctypes.c_void_p(self._base), ctypes.c_size_t(self.nbytes), _MS_SYNC) != 0:
                raise OSError(ctypes.get_errno(), f"memfit disk tier: writing back {self.what} to {self.path}")
            self.written += self._used
        self.dropped += self._used
        _madvise(self._base, self.nbytes, _MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)


_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_WILLNEED, _MADV_DONTNEED, _MS_SYNC = mmap.MADV_WILLNEED, mmap.MADV_DONTNEED, 4  # (Linux's MS_SYNC)


def _madvise(address: int, nbytes: int, advice: int) -> None:
    if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) != 0:
        raise OSError(ctypes.get_errno(), "memfit disk tier: madvise")


def _reserve(fd: int, nbytes: int, path: str, what: str) -> None:
    """Allocate the file's blocks now (See [Note: The disk tier]): no sparse file to fault on."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise ValueError(
            f"memfit disk tier: {os.path.dirname(path)} cannot reserve {nbytes} bytes ({nbytes / 2**30:.2f} GiB) "
            f"for {what} ({e.strerror}); free space there, choose another path, or put fewer units on disk"
        ) from None


def check_room(directory: str, nbytes: int) -> None:
    """Refuse a disk tier of ``nbytes`` where ``directory`` has less free space."""
    if not os.path.isdir(directory):
        raise ValueError(f"memfit disk tier: {directory!r} is not a directory; pass a directory on a local disk")
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise ValueError(
            f"memfit disk tier: {directory} has {free} bytes free ({free / 2**30:.2f} GiB), the tier needs "
            f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB) for this rank; free space there, choose another path, "
            "or put fewer units on disk"
        )


def padded(nbytes: int, tensors: int) -> int:
    """Bytes of a file holding ``tensors`` tensors of ``nbytes`` in all (64-byte aligned each)."""
    return nbytes + 64 * max(tensors, 1) + mmap.PAGESIZE


READ_AHEAD_S = 0.05  # seconds of the disk's reads kept in flight ahead of use
READ_AHEAD_BYTES = 1 << 30  # the most bytes read ahead at once (the buffer's bound)
MAX_READ_AHEAD = 8  # units
_PROBE = 16 << 20  # bytes written and read to measure a disk


@functools.cache
def measured_bandwidth(directory: str) -> tuple[float, float]:
    """(read, write) bytes per second of the disk under ``directory``: a short file written
    through to the disk (fsync) and read back from it (the page cache dropped first), once per
    directory (See [Note: The disk tier])."""
    data = os.urandom(_PROBE)
    fd, path = tempfile.mkstemp(prefix="memfit-probe-", dir=directory)
    try:
        os.unlink(path)
        t0 = time.perf_counter()
        os.write(fd, data)
        os.fsync(fd)
        t1 = time.perf_counter()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t2 = time.perf_counter()
        got = os.pread(fd, _PROBE, 0)
        t3 = time.perf_counter()
    finally:
        os.close(fd)
    assert len(got) == _PROBE
    return _PROBE / max(t3 - t2, 1e-6), _PROBE / max(t1 - t0, 1e-6)


def read_ahead(bandwidth: float, unit_bytes: int) -> int:
    """Units to read ahead of the one computing: about READ_AHEAD_S seconds of a disk reading
    ``bandwidth`` bytes per second, at least one, at most MAX_READ_AHEAD and READ_AHEAD_BYTES."""
    unit_bytes = max(int(unit_bytes), 1)
    depth = math.ceil(bandwidth * READ_AHEAD_S / unit_bytes)
    return max(1, min(depth, MAX_READ_AHEAD, READ_AHEAD_BYTES // unit_bytes))
