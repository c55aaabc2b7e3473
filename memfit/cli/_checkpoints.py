"""Where `memfit train` keeps its checkpoints: one directory per save, ``<dir>/step-00000010``.

Each is written atomically by memfit.save_checkpoint (into ``step-N.tmp-<id>``, renamed when
complete), so a directory named ``step-N`` holding memfit.json is a whole checkpoint and
anything else (a save a killed rank left half-written) is never picked to resume from.
"""

from __future__ import annotations

import os
import re
import shutil

_STEP = re.compile(r"step-(\d+)")


def path_at(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of every whole checkpoint under ``root``, oldest first. A checkpoint saved
    straight into ``root`` by memfit 0.1 counts, at the step its memfit.json records."""
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = _STEP.fullmatch(name)
            if m and os.path.isfile(os.path.join(root, name, "memfit.json")):
                found.append((int(m.group(1)), os.path.join(root, name)))
    if not found and os.path.isfile(os.path.join(root, "memfit.json")):
        found.append((-1, root))  # its step is read when loading
    return sorted(found)


def prune(root: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` whole checkpoints (0: keep all)."""
    if keep_last > 0:
        for _, path in complete(root)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
