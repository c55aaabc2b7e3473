"""Where `memfit train` keeps its checkpoints: one directory per save, ``<dir>/step-00000010``,
each recording the run it belongs to.

Each is written atomically by memfit.save_checkpoint (See [Note: Atomic directory replacement]
in memfit/_persist/_atomic.py), so a directory named ``step-N`` holding memfit.json is a whole
checkpoint and anything else (a save a killed rank left half-written) is never picked to resume
from. A checkpoint's memfit.json records, under ``extra``, its step, its run (``run``: an id,
the config's SHA-256 and the model) and when it was saved (``saved_at``): a fresh run refuses a
directory holding another run's checkpoints, and pruning keeps the newest of the current run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import memfit
from memfit._persist import _atomic
from memfit._persist._checkpoint_files import is_whole, whole_copy

if TYPE_CHECKING:
    from memfit.cli._config import TrainConfig
    from memfit.cli._log import RunLog

_STEP = re.compile(r"step-(\d+)(\.old-[0-9a-f]+)?")
_JSON = "memfit.json"  # written last by memfit.save_checkpoint: a directory holding it is whole
_DCP = ".metadata"  # torch.distributed.checkpoint's index, written before it


def _whole(path: str) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished: its index and, written last, its
    memfit.json (the test memfit.save_checkpoint's own recovery makes)."""
    return os.path.isfile(os.path.join(path, _DCP)) and os.path.isfile(os.path.join(path, _JSON))


def path_at(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def saved_extra(cfg: TrainConfig) -> dict:
    """The ``extra`` values the newest whole checkpoint records, when --resume may load it ({}:
    no --resume, no checkpoint, unreadable: resume says why); rank 0 reads them, every rank
    gets them. A --budget plan is made for the accumulation the resumed run will use (See
    [Note: Elastic restarts]); --trials keeps the configuration it picked."""
    box: list[dict] = [{}]
    if dist.get_rank() == 0 and cfg.resume != "no" and cfg.checkpoint_dir and not cfg.overwrite:
        found = complete(cfg.checkpoint_dir)
        box[0] = extra_of(found[-1][1]) if found else {}
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
            if name in (_JSON, _DCP) or name.endswith(".distcp"):
                os.remove(os.path.join(root, name))


def _remove_unfinished(root: str) -> None:
    """Delete the temporary directories of saves a killed run left (nothing is saving at the
    start of a run), and restore a whole copy a save killed between two renames left aside."""
    if not os.path.isdir(root):
        return
    for _, path in complete(root):
        _atomic.recover(path, is_whole, _JSON)
    for name in os.listdir(root):
        if re.fullmatch(r"step-\d+\.tmp-[0-9a-f]+", name):
            _atomic.remove_dir(os.path.join(root, name), _JSON)


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


# Fields that do not change what a run computes: left out of the config's hash (a resumed
# run may log, save or evaluate differently and is the same run).
_NOT_TRAJECTORY = {
    "resume", "overwrite", "checkpoint_dir", "save_every", "keep_last", "export", "log_every", "metrics",
    "tensorboard", "json", "device", "eval_every", "eval_batches",
}  # fmt: skip


def identity(cfg: TrainConfig, run_id: str) -> dict:
    """What a checkpoint records about the run that saved it."""
    config = {k: v for k, v in asdict(cfg).items() if k not in _NOT_TRAJECTORY}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    spec = cfg.spec()
    model = {"name": spec.name, "arch": spec.arch, "layers": cfg.layers, "hidden": cfg.hidden}
    return {"id": run_id, "config_sha256": digest, "model": model, "config": config}


def claim(cfg: TrainConfig) -> None:
    """Refuse a fresh run into a --checkpoint-dir that holds another run's checkpoints (every
    rank, before the process group forms), unless --resume or --overwrite says what to do."""
    if cfg.resume != "no" or cfg.overwrite or not cfg.checkpoint_dir:
        return
    if complete(cfg.checkpoint_dir):
        raise ValueError(
            f"memfit train: --checkpoint-dir {cfg.checkpoint_dir!r} holds another run's checkpoints "
            f"({describe(cfg.checkpoint_dir)}); pass --resume (or --resume auto) to continue "
            "that run, or --overwrite to delete them and start afresh (or use another directory)"
        )


def resume(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, log: RunLog) -> tuple[int, dict, dict]:
    """Load the checkpoint that --resume asks for into ``model`` and ``opt``: the newest that
    loads and verifies, naming those skipped and why. The step to start at, the run, and the
    ``extra`` values the checkpoint recorded ({} when none was loaded)."""
    step, run = 0, None  # run: what the loaded checkpoint recorded (None: it recorded none)
    extra: dict[str, Any] = {}
    if dist.get_rank() == 0 and cfg.overwrite:
        assert cfg.checkpoint_dir is not None  # TrainConfig requires one with --overwrite
        remove_all(cfg.checkpoint_dir)
    if dist.get_rank() == 0 and cfg.resume != "no":
        assert cfg.checkpoint_dir is not None  # TrainConfig requires one with --resume
        _remove_unfinished(cfg.checkpoint_dir)
    if cfg.resume != "no":
        step, extra = _load_newest(cfg, model, opt, log)
        run = extra.get("run") if isinstance(extra.get("run"), dict) else None
    box = [run["id"] if run else uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(box, src=0)  # one id for every rank (and after --overwrite deleted)
    run_identity = identity(cfg, box[0])
    if run is None:
        return step, run_identity, extra
    changed = sorted(k for k, v in run_identity["config"].items() if run.get("config", {}).get(k, v) != v)
    if changed:
        was = run["config"]
        diff = ", ".join(f"{k} {was[k]!r} -> {getattr(cfg, k)!r}" for k in changed)
        log.say(f"the config differs from the run's: {diff}")
        warning = schedule_change(cfg, was, step)
        if warning:
            log.say(warning)
    return step, run_identity, extra


_SCHEDULE = ("steps", "warmup", "lr")  # the flags TrainConfig.lr_at reads


def schedule_change(cfg: TrainConfig, was: dict, step: int) -> str | None:
    """A warning when the flags of the learning-rate schedule differ from those the checkpoint's
    run saved (None when they agree): what changes, and the flags that keep the saved schedule."""
    if all(was.get(k, getattr(cfg, k)) == getattr(cfg, k) for k in _SCHEDULE):
        return None
    saved = dataclasses.replace(cfg, **{k: was.get(k, getattr(cfg, k)) for k in _SCHEDULE})
    now, before = (
        ", ".join(f"--{k} {getattr(cfg, k)}" for k in _SCHEDULE),
        ", ".join(f"--{k} {getattr(saved, k)}" for k in _SCHEDULE),
    )
    keep = " ".join(f"--{k} {getattr(saved, k)}" for k in _SCHEDULE if getattr(saved, k) != getattr(cfg, k))
    return (
        f"warning: the learning-rate schedule changes from step {step}: the run saved {before}, this one has "
        f"{now} (the lr of step {step + 1}: {saved.lr_at(step):.3e} -> {cfg.lr_at(step):.3e}); "
        f"to keep the saved schedule, pass {keep}"
    )


def _load_newest(cfg: TrainConfig, model, opt, log: RunLog) -> tuple[int, dict]:
    assert cfg.checkpoint_dir is not None  # TrainConfig requires one with --resume
    found = complete(cfg.checkpoint_dir)
    if not found:
        if cfg.resume == "yes":
            raise ValueError(
                f"memfit train: --resume, but {cfg.checkpoint_dir!r} holds no checkpoint; run without "
                "--resume (or with --resume auto) to start from scratch"
            )
        return 0, {}
    skipped = []
    for _, path in reversed(found):
        try:
            extra = memfit.load_checkpoint(path, model, opt)  # refuses before it changes anything
        except (RuntimeError, FileNotFoundError) as e:  # another model's checkpoint, a damaged one: say which
            skipped.append(f"{path!r}: {e}")
            continue
        for why in skipped:
            log.say(f"skipped checkpoint {why}")
        step = extra["step"]
        log.say(f"resumed from step {step} ({path})")
        return step, extra
    bad = "; ".join(skipped)
    raise ValueError(f"memfit train: cannot resume from any checkpoint in {cfg.checkpoint_dir!r}: {bad}")
