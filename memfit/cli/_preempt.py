"""Preemption of `memfit train`: SIGTERM or SIGINT ends the run at a step boundary, checkpointed.
See [Note: Stopping on a signal].
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
import time
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # in the order of the agreed vote's slots
ECHO_S = 1.0  # a repeat within this many seconds is the same preemption delivered twice

# [Note: Stopping on a signal]
# A scheduler preempts a job with SIGTERM (SLURM, Kubernetes; torchrun's agent passes on the
# SIGTERM or SIGINT it gets to its ranks), a user with Ctrl-C (SIGINT). The first one only
# records a request: the step in flight finishes, the ranks agree to stop, a whole checkpoint is
# written (when there is a --checkpoint-dir), rank 0 prints one line naming the step and the
# command that continues, and every rank exits with 128 + the signal's number (143 for SIGTERM,
# 130 for SIGINT: what a shell reports for a process the signal ended, but reached by a clean
# exit). Agreement costs nothing extra: each rank's request rides in the vector the step
# all-reduces anyway for its loss, whose read is the step's one host sync (memfit/cli/_train.py,
# `_agree`), so a signal that reached one node only stops every rank after the same step.
# A second signal stops at once (the process ends by that signal, without saving): the save
# is atomic, so the previous checkpoint stays whole (See [Note: Atomic directory replacement]
# in memfit/_persist/_atomic.py). One preemption often arrives twice within milliseconds (SLURM
# signals every process of the job, and torchrun's agent forwards its own copy), so a repeat
# within ECHO_S seconds of the first counts as the same signal. A stop agreed after the last
# step changes nothing: the run ends as usual (its export included) with status 0.


def exit_status(signum: int) -> int:
    """The exit status of a run a signal stopped cleanly: 128 + its number (SIGTERM: 143)."""
    return 128 + signum


class Preempted(Exception):  # noqa: N818 (a stop, not an error)
    """Raised by :func:`memfit.cli.train` when a signal stopped the run cleanly (after saving,
    when it could); ``status`` is the process's exit status, ``step`` the steps done and
    ``path`` the checkpoint written (None: none could be)."""

    def __init__(self, signum: int, step: int, path: str | None) -> None:
        self.signal = signal.Signals(signum).name
        self.status = exit_status(signum)
        self.step = step
        self.path = path
        super().__init__(f"memfit train: stopped by {self.signal} after step {step}")


class StopRequests:
    """While active (a context manager on the main thread; elsewhere it installs nothing),
    SIGTERM and SIGINT are recorded instead of ending the process; a second one, ECHO_S seconds
    or more after the first, ends it at once. See [Note: Stopping on a signal]."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.first: tuple[int, float] | None = None  # (signal, when) of the first request
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved.clear()

    def votes(self) -> list[float]:
        """This rank's request, one slot per STOP_SIGNALS entry (1.0 for the signal received)."""
        return [float(self.first is not None and self.first[0] == sig) for sig in STOP_SIGNALS]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = (signum, now)
            _write(
                f"memfit train: {name} on rank {self.rank}: finishing the step in flight, then saving "
                "(a second signal stops at once, without saving)"
            )
            return
        if now - self.first[1] < ECHO_S:
            return  # the same preemption, delivered twice
        _write(f"memfit train: second signal ({name}) on rank {self.rank}: stopping now; the last checkpoint is whole")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def agreed_signal(summed_votes: list[float]) -> int | None:
    """The signal every rank stops for, from the votes summed over ranks (SIGTERM over SIGINT);
    None: no rank was asked to stop."""
    for sig, votes in zip(STOP_SIGNALS, summed_votes, strict=True):
        if votes > 0:
            return int(sig)
    return None


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run ``argv`` (``sys.argv``) started: the same flags,
    ``--resume auto`` instead of any --resume or --overwrite."""
    out, skip = ["memfit"], False
    for arg in argv[1:]:
        if skip and arg in ("no", "yes", "auto"):
            skip = False
            continue
        skip = arg == "--resume"
        if arg in ("--resume", "--overwrite") or arg.startswith("--resume="):
            continue
        out.append(arg)
    return shlex.join([*out, "--resume", "auto"])


def _write(text: str) -> None:
    """One line to stderr from a signal handler: os.write, which print's buffer does not reenter."""
    os.write(2, (text + "\n").encode())
