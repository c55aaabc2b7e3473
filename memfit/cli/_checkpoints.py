"""Where `memfit train` keeps its checkpoints: one directory per save, ``<dir>/step-00000010``,
each recording the run it belongs to.

Each is written atomically by memfit.save_checkpoint (See [Note: Atomic directory replacement]
in memfit/_shard/_atomic.py), so a directory named ``step-N`` holding memfit.json is a whole
checkpoint and anything else (a save a killed rank left half-written) is never picked to resume
from. A checkpoint's memfit.json records, under ``extra``, its step, its run (``run``: an id,
the config's SHA-256 and the model) and when it was saved (``saved_at``): a fresh run refuses a
directory holding another run's checkpoints, and pruning keeps the newest of the current run.
"""

from __future__ import annotations

import json
import os
import re

from memfit._shard import _atomic
from memfit._shard._checkpoint_files import whole_copy

_STEP = re.compile(r"step-(\d+)(\.old-[0-9a-f]+)?")
_JSON = "memfit.json"


def path_at(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of every whole checkpoint under ``root``, oldest first. A checkpoint saved
    straight into ``root`` by memfit 0.1 counts, at the step its memfit.json records. A save
    killed between its two renames (filesystems without RENAME_EXCHANGE) counts at its own
    path: memfit.load_checkpoint finds the whole copy."""
    found = set()
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = _STEP.fullmatch(name)
            if m and os.path.isfile(os.path.join(root, name, _JSON)):
                found.add((int(m.group(1)), path_at(root, int(m.group(1))) if m.group(2) else os.path.join(root, name)))
    if not found and os.path.isfile(os.path.join(root, _JSON)):
        found.add((-1, root))  # its step is read when loading
    return sorted(found)


def extra_of(path: str) -> dict:
    """The ``extra`` values the checkpoint at ``path`` recorded ({} when unreadable)."""
    try:
        with open(os.path.join(whole_copy(path), _JSON)) as f:
            extra = json.load(f).get("extra", {})
        return extra if isinstance(extra, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def run_of(path: str) -> str | None:
    """The id of the run that saved the checkpoint at ``path`` (None: saved before runs were recorded)."""
    run = extra_of(path).get("run")
    return run.get("id") if isinstance(run, dict) else None


def describe(root: str) -> str:
    """The checkpoints under ``root``, by run, for an error message."""
    by_run: dict[str, list[int]] = {}
    for step, path in complete(root):
        by_run.setdefault(run_of(path) or "unrecorded", []).append(step)
    return "; ".join(f"run {run}: steps {steps}" for run, steps in by_run.items())


def remove_all(root: str) -> None:
    """Delete every checkpoint under ``root`` and what killed saves left (--overwrite)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if re.fullmatch(r"step-\d+(\.(old|tmp)-[0-9a-f]+)?", name):
            _atomic.remove_dir(os.path.join(root, name), _JSON)
    if os.path.isfile(os.path.join(root, _JSON)):  # memfit 0.1: a checkpoint straight in root
        for name in os.listdir(root):
            if name in (_JSON, ".metadata") or name.endswith(".distcp"):
                os.remove(os.path.join(root, name))


def prune(root: str, keep_last: int, run: str) -> None:
    """Delete all but the newest ``keep_last`` (by the time they were saved) whole checkpoints of
    run ``run`` (0: keep all); other runs' checkpoints are never deleted."""
    if keep_last <= 0:
        return
    mine = []
    for step, path in complete(root):
        extra = extra_of(path)
        if isinstance(extra.get("run"), dict) and extra["run"].get("id") == run:
            mine.append((extra.get("saved_at", 0.0), step, path))
    for _, _, path in sorted(mine)[:-keep_last]:
        _atomic.remove_dir(whole_copy(path), _JSON)
