"""Replacing a directory (a checkpoint, an export) so that a kill at any moment leaves a whole
one at its path; and the error a full disk gives."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import uuid
from collections.abc import Callable

from memfit._instrument import HOOKS

# [Note: Atomic directory replacement]
# A checkpoint is written into `<path>.tmp-<id>` beside `path`; only when every file in it is
# written and synced does it take `path`'s place, in one step:
# - If `path` exists, renameat2(RENAME_EXCHANGE) swaps the two directory entries atomically
#   (Linux >= 3.15; ext4, xfs, btrfs, tmpfs, f2fs and others), so `path` is the old directory up
#   to that instant and the new one after it: there is no moment without a whole one. The old
#   one, now at the temporary name, loses its completion marker (memfit.json) first and is then
#   deleted: a half-deleted one never looks whole.
#   We chose the exchange over versioned directories behind a symlink because `path` stays
#   a plain directory: users copy it, hand it to other tools and load it by name, and
#   checkpoints written before this change are replaced the same way.
# - Where the filesystem refuses the exchange (EINVAL/ENOTSUP: NFS, some FUSE mounts, other
#   kernels), `path` is renamed to `<path>.old-<id>` and the new one renamed in. A kill between
#   the two renames leaves no `path` but a whole `.old-<id>`: load_checkpoint(path) and
#   `memfit train` read it there (`whole_copy`), and `recover`, run before every save to
#   `path`, renames it back.
# - A fresh `path` is one rename.
# `recover` never deletes the only whole copy: `.tmp-*` and `.old-*` leftovers are deleted
# only once `path` itself is whole. (An export shares its directory with other files and
# switches its index instead: See [Note: Exported weights].)
# Tests kill the process (os._exit) at each named step below (`HOOKS.save_step`):
# tests/distributed/test_checkpoint_guarantees.py.

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def step(name: str) -> None:
    """A named moment of a save or an export (where a test can kill the process)."""
    if HOOKS.save_step is not None:
        HOOKS.save_step(name)


@functools.cache
def _renameat2():
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def exchange(a: str, b: str) -> bool:
    """Swap directory entries ``a`` and ``b`` atomically; False where the filesystem (or the C
    library) cannot, having changed nothing."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, f"cannot exchange {a!r} and {b!r}: {os.strerror(err)}")


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary(path: str) -> str:
    """A new empty directory beside ``path`` to write the next version into."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    return tmp


def remove_dir(path: str, marker: str) -> None:
    """Delete directory ``path``, its completion marker first (a half-deleted one is never whole).
    A symbolic link (``path`` was one before the exchange) is removed, never what it points to."""
    if os.path.islink(path):
        os.remove(path)
        return
    try:
        os.remove(os.path.join(path, marker))
    except FileNotFoundError:
        pass
    step("replace:old-unmarked")
    shutil.rmtree(path, ignore_errors=True)


def replace(tmp: str, path: str, marker: str) -> None:
    """Put the whole directory ``tmp`` at ``path``, atomically (See [Note: Atomic directory
    replacement]); the previous ``path``, if any, is deleted after."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        step("replace:renamed")
    elif exchange(tmp, path):
        step("replace:exchanged")
        sync_dir(parent)
        remove_dir(tmp, marker)
    else:
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        step("replace:old-moved")
        os.rename(tmp, path)
        step("replace:renamed")
        sync_dir(parent)
        remove_dir(old, marker)
    sync_dir(parent)


def recover(path: str, whole: Callable[[str], bool], marker: str) -> None:
    """Undo what a save or export to ``path`` killed midway left: a whole ``.old-*`` copy goes
    back to ``path`` if ``path`` is missing; then, once ``path`` is whole, the leftovers go."""
    parent, base = os.path.split(path)
    if not os.path.isdir(parent):
        return
    names = sorted(os.listdir(parent))
    olds = [os.path.join(parent, n) for n in names if n.startswith(f"{base}.old-")]
    if not os.path.lexists(path):
        back = [o for o in olds if whole(o)]
        if back:
            os.rename(back[-1], path)
            sync_dir(parent)
    if not whole(path):
        return
    for n in names:
        if n.startswith((f"{base}.tmp-", f"{base}.old-")) and os.path.isdir(os.path.join(parent, n)):
            remove_dir(os.path.join(parent, n), marker)


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it, or a rank's failure inside a torch CheckpointException)
    is a full disk or quota."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x)
        if "No space left" in text or "unexpected pos" in text:  # torch's zip writer on a short write
            return True
        todo += [x.__cause__, x.__context__]
        for failure in (getattr(x, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, tb)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


def no_space(where: str, path: str, needed: int | None, kept: str) -> OSError:
    """The error of a write to ``path`` that found the disk full."""
    free = shutil.disk_usage(os.path.dirname(path) or ".").free
    need = f" it needs about {_size(needed)} ({needed} bytes);" if needed else ""
    return OSError(
        errno.ENOSPC,
        f"{where}: no space left on the device for {path!r}:{need} {_size(free)} are free. The partial files are "
        f"removed; {kept}. Free some space there (or raise the quota), or write elsewhere",
    )


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
