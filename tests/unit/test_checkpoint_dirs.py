"""`memfit train`'s checkpoint directory (memfit/cli/_checkpoints.py) on fabricated checkpoints:
which count as whole, which run owns them, what pruning deletes, what a fresh run refuses;
and save_checkpoint's keywords. No process group: the checkpoints' memfit.json is all these read."""

import json
import os

import pytest

import memfit
from memfit.cli import _checkpoints
from memfit.cli._train import TrainConfig


def fake(root, name, run=None, saved_at=0.0, step=None):
    """A directory that looks like a whole checkpoint (memfit.json and .metadata)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    extra = {"step": step, **({"run": {"id": run}, "saved_at": saved_at} if run else {})}
    with open(os.path.join(path, "memfit.json"), "w") as f:
        json.dump({"version": 2, "optimizer_groups": [], "extra": extra}, f)
    open(os.path.join(path, ".metadata"), "wb").close()
    return path


def test_whole_checkpoints_only(tmp_path):
    root = str(tmp_path)
    fake(root, "step-00000002", "a")
    os.makedirs(tmp_path / "step-00000004.tmp-0a1b2c3d")  # a save killed midway
    fake(root, "step-00000006.old-0a1b2c3d", "a")  # killed between the two renames (no RENAME_EXCHANGE)
    os.makedirs(tmp_path / "step-00000008")  # no memfit.json: never finished
    assert _checkpoints.complete(root) == [
        (2, os.path.join(root, "step-00000002")),
        (6, os.path.join(root, "step-00000006")),  # load_checkpoint finds the .old copy
    ]
    assert _checkpoints.run_of(os.path.join(root, "step-00000006")) == "a"


def test_prune_keeps_the_newest_of_this_run_and_never_another_runs(tmp_path):
    root = str(tmp_path)
    fake(root, "step-00000001", None)  # saved before runs were recorded
    fake(root, "step-00000003", "other", saved_at=50.0)
    fake(root, "step-00000009", "other", saved_at=60.0)
    # this run resumed from step 4 after skipping a damaged step 8: step 6 is newer than step 8
    fake(root, "step-00000002", "me", saved_at=10.0)
    fake(root, "step-00000004", "me", saved_at=20.0)
    fake(root, "step-00000008", "me", saved_at=30.0)
    fake(root, "step-00000006", "me", saved_at=40.0)
    _checkpoints.prune(root, 2, "me")
    assert sorted(os.listdir(root)) == [
        "step-00000001",
        "step-00000003",
        "step-00000006",
        "step-00000008",
        "step-00000009",
    ]
    _checkpoints.prune(root, 1, "me")
    assert "step-00000006" in os.listdir(root) and "step-00000008" not in os.listdir(root)
    _checkpoints.prune(root, 0, "me")  # 0: keep all
    assert len(os.listdir(root)) == 4


def test_a_fresh_run_refuses_another_runs_directory(tmp_path):
    root = str(tmp_path / "ck")
    _checkpoints.claim(TrainConfig(checkpoint_dir=root))  # an empty (missing) directory is fine
    os.makedirs(tmp_path / "ck" / "step-00000002.tmp-0a1b2c3d")  # a partial save is not a checkpoint
    _checkpoints.claim(TrainConfig(checkpoint_dir=root))
    fake(root, "step-00000004", "a")
    fake(root, "step-00000006", "a")
    with pytest.raises(ValueError) as e:
        _checkpoints.claim(TrainConfig(checkpoint_dir=root))
    msg = str(e.value)
    assert repr(root) in msg and "run a: steps [4, 6]" in msg, msg
    assert "--resume" in msg and "--overwrite" in msg, msg
    _checkpoints.claim(TrainConfig(checkpoint_dir=root, resume="auto"))
    _checkpoints.claim(TrainConfig(checkpoint_dir=root, overwrite=True))
    _checkpoints.remove_all(root)  # what --overwrite does (rank 0, after the group forms)
    assert os.listdir(root) == []


def test_overwrite_and_resume_are_exclusive():
    with pytest.raises(ValueError, match="pass one of the two"):
        TrainConfig(checkpoint_dir="ck", overwrite=True, resume="auto")
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        TrainConfig(overwrite=True)


def test_save_checkpoint_takes_extra_explicitly():
    # Refused when the call binds, before anything is written (no process group needed)
    with pytest.raises(TypeError, match="step"):
        memfit.save_checkpoint("ck", None, None, step=3)  # extra={"step": 3}
    with pytest.raises(TypeError, match="extra= takes a dict"):
        memfit.save_checkpoint("ck", None, None, extra=[("step", 3)])


def test_replacing_a_symlinked_checkpoint_keeps_its_target(tmp_path):
    from memfit._persist import _atomic

    target = fake(str(tmp_path), "elsewhere", "a", step=1)
    os.symlink(target, tmp_path / "ckpt")
    new = fake(str(tmp_path), "ckpt.tmp-0a1b2c3d", "a", step=2)
    _atomic.replace(new, str(tmp_path / "ckpt"), "memfit.json")
    assert not os.path.islink(tmp_path / "ckpt") and _checkpoints.extra_of(str(tmp_path / "ckpt"))["step"] == 2
    assert _checkpoints.extra_of(target)["step"] == 1  # the link went, not what it pointed to
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere"]
