"""The process that test_checkpoint_guarantees starts: saves and exports killed at every step,
a full disk, an unwritable directory. Run as ``python -m tests.distributed._checkpoint_kills ROOT``;
writes ROOT/report.json, {trial name: None (passed) or what failed, "skipped": {name: reason}}.

torch is imported once here; each trial is a fork of this process (nothing here has started a
thread or a process group before it forks) that forms its own one-rank gloo group. A trial
saves (or exports) a first version, then a second with memfit's step hook set to end the
process with ``os._exit`` at the step under test: a real death, no ``finally`` runs. A second
fork then loads what is at the path, checks it is the whole first version (killed before the
commit point) or the whole second one (after it), saves again and checks that nothing the kill
left behind remains.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit._persist import _atomic
from memfit.testing import save_steps
from tests._models import make_model

KILLED = 77
SAVE_STEPS = [
    "save:tmp-created",
    "save:written",
    "save:checksummed",
    "save:info-written",
    "replace:exchanged",  # the commit point: from here on, the second version is at the path
    "replace:old-unmarked",
    "save:done",
]
FALLBACK_STEPS = ["replace:old-moved", "replace:renamed", "replace:old-unmarked"]  # no RENAME_EXCHANGE
EXPORT_STEPS = [
    "export:started",
    "export:shard-written",
    "export:configs-written",
    "export:index-written",  # the commit point
    "export:done",
]
COMMIT = {"replace:exchanged", "replace:renamed", "export:index-written"}


def _fork(root: str, fn, *args) -> str | None:
    """Run ``fn(*args)`` in a forked process with its own one-rank gloo group; None if it
    returned, "killed" if it ended with os._exit(KILLED), else its traceback."""
    store = os.path.join(root, f"store-{os.urandom(4).hex()}")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            fn(*args)
            code = 0
        except BaseException:
            with open(f"{store}.err", "w") as f:
                f.write(traceback.format_exc())
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    if code == KILLED:
        return "killed"
    err = f"{store}.err"
    return open(err).read() if os.path.exists(err) else f"exit status {code}"


def build():
    torch.manual_seed(0)
    model = memfit.FullyShardedDataParallel(make_model("mlp"), auto_wrap_policy=nn.Sequential)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    loss = nn.functional.mse_loss(model(torch.randn(4, 6, generator=g)), torch.randn(4, 3, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()


def full(model) -> dict[str, list[float]]:
    with memfit.summon_full_params(model, writeback=False):
        return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def kill_at(name: str):
    def hook(step: str) -> None:
        if step == name:
            os._exit(KILLED)

    return hook


def two_versions(path: str, expected: str, kill: str | None, what: str, fallback: bool) -> None:
    """Save or export version 1, then version 2 killed at step ``kill``; the weights of each go to ``expected``."""
    if fallback:
        _atomic.exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
    model, opt = build()
    versions = {}
    for version in (1, 2):
        train_step(model, opt, version)
        versions[version] = full(model)
        with open(expected, "w") as f:
            json.dump(versions, f)
        with save_steps(kill_at(kill) if version == 2 else None):
            if what == "save":
                memfit.save_checkpoint(path, model, opt, extra={"step": version})
            elif what == "async-save":  # the write runs on memfit's thread while training goes on
                future = memfit.save_checkpoint(path, model, opt, extra={"step": version}, async_=True)
                train_step(model, opt, 10 + version)
                future.result()
            else:
                memfit.export_safetensors(model, path)
    raise AssertionError(f"the step {kill!r} was never reached")


def exported(path: str) -> dict[str, list[float]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(path, name)))
    plain = make_model("mlp")
    plain.load_state_dict(state)  # strict: every key, from one export
    return {n: p.detach().reshape(-1).tolist() for n, p in plain.named_parameters()}


def check_after(path: str, expected: str, want: int, what: str) -> None:
    """What is at ``path`` is whole and is version ``want``; a new save or export leaves nothing else behind."""
    with open(expected) as f:
        versions = {int(k): v for k, v in json.load(f).items()}
    model, opt = build()
    if what != "export":
        step = memfit.load_checkpoint(path, model, opt)["step"]  # verifies every chunk's checksum
        assert step == want, f"found version {step}, expected {want}"
        assert full(model) == versions[want]
        memfit.save_checkpoint(path, model, opt, extra={"step": 3})
        assert memfit.load_checkpoint(path, *build())["step"] == 3
        left = sorted(os.listdir(os.path.dirname(path)))
        assert left == [os.path.basename(path)], f"left behind: {left}"
    else:
        got = exported(path)
        assert got == versions[want], f"the export is not version {want}"
        memfit.export_safetensors(model, path)
        assert exported(path) == full(model)
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        left = sorted(set(os.listdir(path)) - set(index["weight_map"].values()))
        assert left == ["model.safetensors.index.json", "tokenizer.json"], f"left behind: {left}"


def kill_trial(root: str, what: str, kill: str, fallback: bool, steps: list[str]) -> str | None:
    where = os.path.join(root, f"{what}-{'fallback-' if fallback else ''}{kill.replace(':', '-')}")
    os.makedirs(where)
    path = os.path.join(where, "export" if what == "export" else "ckpt")
    if what == "export":
        os.makedirs(path)
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")  # another file in the export directory: left alone
    expected = os.path.join(root, f"{os.path.basename(where)}.json")
    out = _fork(root, two_versions, path, expected, kill, what, fallback)
    if out != "killed":
        return f"the trial did not die at {kill}: {out}"
    committed = any(s in COMMIT for s in steps[: steps.index(kill) + 1])
    return _fork(root, check_after, path, expected, 2 if committed else 1, what)


# -- a full disk, an unwritable directory ------------------------------------------------------


def full_disk(disk: str, expected: str) -> None:
    """On a 1 MiB tmpfs: version 1 saved and exported, the disk filled to less than half a
    checkpoint, version 2 refused with "no space left", the partial files gone, version 1 whole."""
    model, opt = build()
    train_step(model, opt, 1)
    ckpt, export = os.path.join(disk, "ckpt"), os.path.join(disk, "export")
    memfit.save_checkpoint(ckpt, model, opt, extra={"step": 1})
    memfit.export_safetensors(model, export)
    one = full(model)
    size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
    free = shutil.disk_usage(disk).free
    with open(os.path.join(disk, "filler"), "wb") as f:
        f.write(b"\0" * (free - 4096))
    before = sorted(os.listdir(disk)), sorted(os.listdir(export))
    train_step(model, opt, 2)
    for name, save in (
        ("save", lambda: memfit.save_checkpoint(ckpt, model, opt, extra={"step": 2})),
        ("export", lambda: memfit.export_safetensors(model, export)),
    ):
        try:
            save()
            raise AssertionError(f"{name} on a full disk did not fail ({size} bytes a checkpoint, {free} were free)")
        except OSError as e:
            msg = str(e)
            assert e.errno == errno.ENOSPC and "no space left" in msg, msg
            assert repr(ckpt if name == "save" else export) in msg or export in msg, msg
            assert "needs about" in msg and "untouched" in msg, msg
        assert (sorted(os.listdir(disk)), sorted(os.listdir(export))) == before, os.listdir(disk)
    model2, opt2 = build()
    assert memfit.load_checkpoint(ckpt, model2, opt2)["step"] == 1 and full(model2) == one
    assert exported(export) == one


def failing_fsync(where: str) -> None:
    """A writer that fails with ENOSPC (os.fsync, as on a disk that fills while data is flushed)."""
    model, opt = build()
    train_step(model, opt, 1)
    ckpt, export = os.path.join(where, "ckpt"), os.path.join(where, "export")
    memfit.save_checkpoint(ckpt, model, opt, extra={"step": 1})
    memfit.export_safetensors(model, export)
    one = full(model)
    real = os.fsync

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    train_step(model, opt, 2)
    os.fsync = fsync
    try:
        for name, save in (
            ("save", lambda: memfit.save_checkpoint(ckpt, model, opt, extra={"step": 2})),
            ("export", lambda: memfit.export_safetensors(model, export)),
        ):
            try:
                save()
                raise AssertionError(f"{name}: a writer failing with ENOSPC did not fail")
            except OSError as e:
                assert "no space left" in str(e) and "needs about" in str(e), str(e)
    finally:
        os.fsync = real
    assert sorted(os.listdir(where)) == ["ckpt", "export"], os.listdir(where)
    model2, opt2 = build()
    assert memfit.load_checkpoint(ckpt, model2, opt2)["step"] == 1 and full(model2) == one
    assert exported(export) == one


def failing_async_write(where: str) -> None:
    """An asynchronous save whose writer fails (ENOSPC from fsync, on memfit's thread): the
    future raises it, version 1 loads, and the next save works."""
    model, opt = build()
    train_step(model, opt, 1)
    ckpt = os.path.join(where, "ckpt")
    memfit.save_checkpoint(ckpt, model, opt, extra={"step": 1}, async_=True).result()
    one = full(model)
    train_step(model, opt, 2)
    real = os.fsync

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = fsync
    try:
        future = memfit.save_checkpoint(ckpt, model, opt, extra={"step": 2}, async_=True)
        error = future.exception()
    finally:
        os.fsync = real
    assert isinstance(error, OSError) and "no space left" in str(error), repr(error)
    assert sorted(os.listdir(where)) == ["ckpt"], os.listdir(where)
    model2, opt2 = build()
    assert memfit.load_checkpoint(ckpt, model2, opt2)["step"] == 1 and full(model2) == one
    memfit.save_checkpoint(ckpt, model, opt, extra={"step": 2})  # the failure was read: no error again
    assert memfit.load_checkpoint(ckpt, *build())["step"] == 2


def read_only(disk: str) -> None:
    """A directory that became read-only: the error names the path and the reason; version 1 loads."""
    model, opt = build()
    ckpt = os.path.join(disk, "ckpt")
    try:
        memfit.save_checkpoint(ckpt, model, opt, extra={"step": 2})
        raise AssertionError("a save to a read-only file system did not fail")
    except OSError as e:
        assert repr(ckpt) in str(e) and "Read-only file system" in str(e), str(e)
    assert memfit.load_checkpoint(ckpt, *build())["step"] == 1


def main(root: str) -> None:
    torch.set_num_threads(1)
    report: dict = {"skipped": {}}
    for what, steps, fallback in (
        ("save", SAVE_STEPS, False),
        ("save", FALLBACK_STEPS, True),
        ("async-save", SAVE_STEPS, False),
        ("export", EXPORT_STEPS, False),
    ):
        for kill in steps:
            report[f"{what}{'-fallback' if fallback else ''}-killed-at-{kill}"] = kill_trial(
                root, what, kill, fallback, steps
            )
    where = os.path.join(root, "enospc")
    os.makedirs(where)
    report["writer-fails-with-enospc"] = _fork(root, failing_fsync, where)
    where = os.path.join(root, "async-enospc")
    os.makedirs(where)
    report["async-writer-fails"] = _fork(root, failing_async_write, where)
    disk = os.path.join(root, "tmpfs")
    os.makedirs(disk)
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk]
    mount = subprocess.run(command, check=False, capture_output=True, text=True)
    if mount.returncode != 0:
        reason = f"mount -t tmpfs refused: {mount.stderr.strip() or mount.returncode} (needs root)"
        report["skipped"].update({"full-tmpfs": reason, "read-only": reason})
    else:
        try:
            report["full-tmpfs"] = _fork(root, full_disk, disk, os.path.join(root, "full.json"))
            os.remove(os.path.join(disk, "filler"))
            subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
            report["read-only"] = _fork(root, read_only, disk)
        finally:
            subprocess.run(["umount", disk], check=False)
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
