"""memfit train preempted by real signals, as a scheduler or a user sends them (See [Note: Stopping
on a signal] in memfit/cli/_preempt.py): SIGTERM after a step marker is in the log stops at the
next step boundary with a whole checkpoint, one line and status 143, and the printed command
continues bitwise; a second signal in the middle of that save ends the process at once (status 143,
not by the signal) and the previous checkpoint stays whole; under torchrun a SIGTERM to one rank
stops both at one step, and the rank still leaving when the agent signals it (the other rank
exited first) exits 143 too, never by the signal; Ctrl-C without --checkpoint-dir says nothing
could be saved (status 130)."""

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from memfit.cli._checkpoints import complete
from tests.distributed.test_train import TINY, read

STEPS = ["--steps", "30"]  # enough that the run is still going when the signal comes
STOPPED = re.compile(r"stopped by (SIG\w+) after step (\d+) of 30; saved checkpoint (\S+); continue with: (.*)")


def _env():
    path = os.pathsep.join(filter(None, [str(Path(memfit.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MEMFIT_PG_TIMEOUT": "30"}


def _command(args, torchrun=0, entry=("-m", "memfit", "train")):
    if torchrun:
        exe = str(Path(sys.executable).parent / "torchrun")
        return [exe, "--standalone", f"--nproc-per-node={torchrun}", "--max-restarts=0", *entry, *TINY, *args]
    return [sys.executable, *entry, *TINY, *args]


def _run(args, torchrun=0):
    cmd = _command(args, torchrun)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _start(args, torchrun=0, entry=("-m", "memfit", "train")):
    cmd = _command(args, torchrun, entry)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())


def _wait_for(proc, marker):
    """The output up to the line holding ``marker`` (the run is past that step when it returns)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    proc.wait()
    pytest.fail(f"{marker!r} never came (status {proc.returncode}):\n{''.join(seen)[-3000:]}")


def _finish(proc, seen):
    rest, _ = proc.communicate(timeout=300)
    return seen + rest


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run, one process and two ranks: what a preempted one must end equal to."""
    tmp = tmp_path_factory.mktemp("whole")
    _run([*STEPS, "--json", str(tmp / "w1.json")])
    return tmp


def test_sigterm_saves_the_step_and_the_printed_command_continues_bitwise(tmp_path, whole):
    ck = tmp_path / "ck"
    proc = _start([*STEPS, "--checkpoint-dir", str(ck)])  # no --save-every: saved on the stop only
    seen = _wait_for(proc, "step 2/30")
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, seen)
    assert proc.returncode == 143, out[-3000:]
    assert "SIGTERM on rank 0: finishing the step in flight, then saving" in out
    stopped = STOPPED.search(out)
    assert stopped and stopped[1] == "SIGTERM", out[-3000:]
    step = int(stopped[2])
    assert 2 <= step < 30
    assert complete(str(ck)) == [(step, str(ck / f"step-{step:08d}"))] and stopped[3] == str(ck / f"step-{step:08d}")
    assert "Traceback" not in out
    command = shlex.split(stopped[4])
    assert command[:2] == ["memfit", "train"] and command[-2:] == ["--resume", "auto"]
    rest = tmp_path / "rest.json"
    resumed = subprocess.run(
        [sys.executable, "-m", "memfit", *command[1:], "--json", str(rest)],
        check=False, capture_output=True, text=True, timeout=400, env=_env(),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from step {step}" in resumed.stdout
    full, cont = read(whole / "w1.json"), read(rest)
    assert [e["step"] for e in cont["log"]] == list(range(step + 1, 31))
    assert [e["loss"] for e in cont["log"]] == [e["loss"] for e in full["log"][step:]]
    assert cont["params_sha256"] == full["params_sha256"]
    assert [s for s, _ in complete(str(ck))] == [step, 30]  # a --checkpoint-dir alone saves at the end


def test_a_second_signal_mid_save_ends_at_once_and_the_last_checkpoint_survives(tmp_path, whole):
    ck = tmp_path / "ck"
    fault = str(Path(__file__).with_name("_train_with_fault.py"))
    flags = ["--term-at-step", "3", "--term-again-in-save", *STEPS, "--checkpoint-dir", str(ck), "--save-every", "2"]
    proc = _start(flags, entry=(fault,))
    out = _finish(proc, "")
    assert proc.returncode == 143, out[-3000:]  # ended by the second signal, in the step-4 save, not killed by it
    assert "second signal (SIGTERM) on rank 0: stopping now" in out and "stopped by" not in out, out[-3000:]
    assert [s for s, _ in complete(str(ck))] == [2]
    assert any(".tmp-" in n for n in os.listdir(ck))  # the interrupted save's leftovers, never picked
    rest = tmp_path / "rest.json"
    out = _run([*STEPS, "--checkpoint-dir", str(ck), "--resume", "auto", "--json", str(rest)])
    assert f"resumed from step 2 ({ck / 'step-00000002'})" in out
    assert read(rest)["params_sha256"] == read(whole / "w1.json")["params_sha256"]


def _rank_pid(root: int, rank: int) -> int:
    """The pid of the torchrun worker of ``rank`` among the descendants of ``root``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= new
        grew = bool(new)
    for pid in tree - {root}:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env):
            return pid
    pytest.fail(f"no rank {rank} under torchrun pid {root}")


def test_sigterm_to_one_rank_stops_every_rank_after_one_step(tmp_path, whole):
    _run([*STEPS, "--json", str(whole / "w2.json")], torchrun=2)
    ck = tmp_path / "ck"
    fault = str(Path(__file__).with_name("_train_with_fault.py"))
    # rank 0 leaves 5 s late: rank 1 exits first, and the agent SIGTERMs rank 0 while it leaves
    proc = _start([*STEPS, "--checkpoint-dir", str(ck), "--linger-after-stop", "5"], torchrun=2, entry=(fault,))
    seen = _wait_for(proc, "step 2/30")
    os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)  # one node preempted: rank 0 gets no signal
    out = _finish(proc, seen)
    stopped = STOPPED.search(out)
    assert stopped, out[-3000:]
    step = int(stopped[2])
    assert complete(str(ck)) == [(step, str(ck / f"step-{step:08d}"))]  # whole, written by both ranks
    assert "exitcode  : 143" in out, out[-3000:]  # torchrun's report of the ranks it saw stop
    assert "Signal 15" not in out and "exitcode  : -15" not in out, out[-3000:]  # no rank ended by the signal
    rest = tmp_path / "rest.json"
    out = _run([*STEPS, "--checkpoint-dir", str(ck), "--resume", "auto", "--json", str(rest)], torchrun=2)
    assert f"resumed from step {step}" in out
    assert read(rest)["params_sha256"] == read(whole / "w2.json")["params_sha256"]


def test_ctrl_c_without_a_checkpoint_dir_stops_saying_nothing_was_saved(tmp_path):
    proc = _start(STEPS)
    seen = _wait_for(proc, "step 2/30")
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, seen)
    assert proc.returncode == 130, out[-3000:]
    assert re.search(r"stopped by SIGINT after step \d+ of 30; nothing could be saved \(no --checkpoint-dir", out)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
