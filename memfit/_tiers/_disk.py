"""The disk tier: tensors that live in files on a local disk, read ahead of use and written
back behind it (See [Note: The disk tier])."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

import torch

__all__ = ["DiskFile", "check_room", "padded"]

# [Note: The disk tier]
# A DiskFile maps one file on a local disk (MAP_SHARED) and hands out tensors that are views
# of the mapping: what a unit keeps on disk (its parameter shards, then its optimizer state)
# is those tensors, so every op on them (the gather's copy-in, the optimizer step, a
# checkpoint's read and its load) is the same arithmetic as on host memory, only the storage
# differs: the results are bitwise those of the host tier.
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
#   (`check_room`), naming the path and the bytes.
# Only on Linux (and other POSIX systems with madvise); the mapping's alignment is the page.


class DiskFile:
    """One file of the disk tier, mapped; :meth:`tensor` gives views of it."""

    def __init__(self, directory: str, nbytes: int, what: str) -> None:
        self.what = what  # named in errors
        self.nbytes = max(int(nbytes), 1)
        fd, self.path = tempfile.mkstemp(prefix="memfit-tier-", suffix=".bin", dir=directory)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.unlink(self.path)  # See [Note: The disk tier]: scratch, gone with the process
        self._fd = fd
        self._used = 0
        self.written = 0  # bytes written back by release(dirty=True) (tests and the planner's check read these)
        self.dropped = 0  # bytes dropped from memory by release: read again at their next use

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A new tensor in the file, shaped and typed as ``like``, holding ``like``'s values."""
        nbytes = like.numel() * like.element_size()
        start = -(-self._used // 64) * 64  # 64-byte aligned, as the CPU kernels' vector loads like it
        if start + nbytes > self.nbytes:
            raise RuntimeError(
                f"memfit disk tier: {self.what} needs {start + nbytes} bytes of its file {self.path}, "
                f"sized {self.nbytes}; this is a bug in memfit, please report it"
            )
        self._used = start + nbytes
        if like.numel() == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        flat = torch.frombuffer(self._map, dtype=like.dtype, count=like.numel(), offset=start)
        out = flat.view(like.shape)
        out.copy_(like)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is in this file."""
        if t.numel() == 0:
            return True
        base = self.base()
        return base <= t.untyped_storage().data_ptr() < base + self.nbytes

    def base(self) -> int:
        probe = torch.frombuffer(self._map, dtype=torch.uint8, count=1)
        return probe.data_ptr()

    def prefetch(self) -> None:
        """Read the file ahead of use, in the background (See [Note: The disk tier])."""
        self._map.madvise(mmap.MADV_WILLNEED)

    def release(self, dirty: bool) -> None:
        """Write back (``dirty``) and drop the file's pages from memory."""
        if dirty:
            self._map.flush()
            self.written += self._used
        self.dropped += self._used
        self._map.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)


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
