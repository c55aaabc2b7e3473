"""memfit train: resumes exactly, and survives a killed rank under torchrun."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import memfit

TINY = ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "4", "--steps", "6", "--lr", "1e-3"]


def memfit_train(*args, torchrun=0, fail_at_step=None, check=True):
    # Up to 3 restarts, and a 20 s process-group timeout so that a restarted group that stalls
    # fails and is restarted rather than waiting. With fail_at_step, the last rank is killed at
    # the start of the step after that many steps, on the first attempt (tests/_train_with_fault.py).
    if fail_at_step is None:
        entry = ["-m", "memfit", "train"]
    else:
        entry = [str(Path(__file__).parents[1] / "_train_with_fault.py"), "--fail-at-step", str(fail_at_step)]
    if torchrun:
        exe = str(Path(sys.executable).parent / "torchrun")
        cmd = [exe, "--standalone", f"--nproc-per-node={torchrun}", "--max-restarts=3", *entry]
    else:
        cmd = [sys.executable, *entry]
    # The children import the memfit under test (this checkout's), whatever the working directory.
    path = os.pathsep.join(filter(None, [str(Path(memfit.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MEMFIT_PG_TIMEOUT": "20", "PYTHONPATH": path}  # a stuck restarted group fails fast
    proc = subprocess.run([*cmd, *TINY, *args], check=False, capture_output=True, text=True, timeout=400, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read(path):
    return json.loads(Path(path).read_text())


def test_resume_continues_exactly(tmp_path):
    memfit_train("--json", str(tmp_path / "whole.json"))
    killed = memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2", fail_at_step=4, check=False)
    assert killed.returncode == -signal.SIGKILL  # at the start of step 5, after the step-4 checkpoint
    memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--json", str(tmp_path / "rest.json"))
    whole, rest = read(tmp_path / "whole.json"), read(tmp_path / "rest.json")
    assert [e["step"] for e in rest["log"]] == [5, 6]
    assert [e["loss"] for e in rest["log"]] == [e["loss"] for e in whole["log"][4:]]
    assert rest["params_sha256"] == whole["params_sha256"]


def test_torchrun_restarts_after_a_killed_rank(tmp_path):
    memfit_train("--json", str(tmp_path / "whole.json"), torchrun=2)
    # Known flake of torch 2.13's gloo on this machine, not of memfit: in about one run in five
    # the restarted group cannot form its mesh ("connectFullMesh failed ... Connection
    # refused") on every restart torchrun allows. Only that failure is retried, with a fresh
    # job; any other outcome is judged at once.
    for attempt in range(3):
        ck = tmp_path / f"ck{attempt}"
        proc = memfit_train(
            "--checkpoint-dir", str(ck), "--save-every", "2", "--resume", "auto",
            "--json", str(tmp_path / "restarted.json"), torchrun=2, fail_at_step=3, check=False,
        )  # fmt: skip
        if proc.returncode == 0 or "connectFullMesh failed" not in proc.stdout + proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    whole, restarted = read(tmp_path / "whole.json"), read(tmp_path / "restarted.json")
    assert whole["world_size"] == restarted["world_size"] == 2
    assert [e["step"] for e in restarted["log"]] == [3, 4, 5, 6]  # resumed from the step-2 checkpoint
    assert restarted["params_sha256"] == whole["params_sha256"]


def test_errors(tmp_path):
    proc = memfit_train("--checkpoint-dir", str(tmp_path / "none"), "--resume", "yes", check=False)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "6")
    proc = memfit_train("--model", "gpt2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "yes", check=False)
    assert proc.returncode == 2 and "cannot resume from" in proc.stderr and "missing keys" in proc.stderr
    proc = memfit_train("--model", "t5", check=False)
    assert proc.returncode == 2 and "unknown model 't5'" in proc.stderr


def test_accumulate_more_micro_batches_than_batch_rows(tmp_path):
    # --batch is the micro-batch per rank: 2 rows x 4 micro-batches = 8 rows a step
    memfit_train("--batch", "2", "--accumulate", "4", "--steps", "2", "--json", str(tmp_path / "acc.json"))
    assert [e["step"] for e in read(tmp_path / "acc.json")["log"]] == [1, 2]
