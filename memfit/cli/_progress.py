"""Progress of a command's long phases: a line when a phase starts (stdout, with the answer),
and on stderr, while it runs, a line every ``every`` seconds saying it is still at work and, at
its end, how long it took; so that `memfit plan --auto` on a large model is never minutes of
silence. See [Note: Progress of long phases]."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

# [Note: Progress of long phases]
# A phase (building the model, profiling, solving, the --auto search, --trials) prints what it
# does when it starts, on stdout beside the results (a log reads in order), then, if it runs
# longer than ``every`` seconds, a line on stderr every ``every`` seconds from a daemon thread
# (the phase's own code is the library's and reports nothing: the thread only waits on an
# Event, it reads nothing of the phase) and one when it ends, with its wall time. Only
# lines: they read the same on a terminal, in a CI log and through a pipe, and stdout stays
# the answer. A phase whose library call reports where it is (memfit.autoconfigure's
# ``progress=``) is given the callable the phase yields: each line it is told goes to stderr
# at once, and the ticker's lines say the last one.
EVERY_S = 15.0


@contextlib.contextmanager
def phase(
    where: str, what: str, *, shown: bool = True, every: float = EVERY_S, err: TextIO | None = None
) -> Iterator[Callable[[str], None]]:
    """``where: what`` on stdout, then progress lines on ``err`` (stderr) while the block runs
    (See [Note: Progress of long phases]); nothing where not ``shown`` (ranks other than 0).
    Yields the callable that reports a step of the phase (a line on ``err``)."""
    if not shown:
        yield lambda line: None
        return
    err = sys.stderr if err is None else err
    print(f"{where}: {what}", flush=True)
    done, start = threading.Event(), time.perf_counter()
    last = [""]  # the last step reported

    def report(line: str) -> None:
        last[0] = f" ({line})"
        print(f"{where}: {line}, {time.perf_counter() - start:.0f} s in", file=err, flush=True)

    def tick() -> None:
        while not done.wait(every):
            so_far = f"{time.perf_counter() - start:.0f} s so far{last[0]}"
            print(f"{where}: {what}: still at it, {so_far}", file=err, flush=True)

    ticker = threading.Thread(target=tick, name="memfit-progress", daemon=True)
    ticker.start()
    try:
        yield report
    finally:
        done.set()
        ticker.join()
        seconds = time.perf_counter() - start
        if seconds >= every:
            print(f"{where}: {what}: done in {seconds:.0f} s", file=err, flush=True)
