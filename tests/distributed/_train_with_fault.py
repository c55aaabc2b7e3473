"""`memfit train` with a rank that dies: the entry point tests/distributed/test_train.py launches with
python or torchrun in place of `-m memfit train`.

    _train_with_fault.py --fail-at-step N [memfit train flags]
    _train_with_fault.py --fail-in-save N [memfit train flags]
    _train_with_fault.py --term-at-step N --term-again-in-save [memfit train flags]
    _train_with_fault.py --linger-after-stop S [memfit train flags]

The last rank kills itself with SIGKILL (as a crash or the OOM killer would: no clean-up, no
exit handler) on torchrun's first attempt only, so that the restarted job runs through:
--fail-at-step N at the start of the step after N steps done (through train's ``on_step``
hook); --fail-in-save N in the middle of the N-th save_checkpoint, right after it wrote its
own shard files (before the checkpoint is complete). --term-at-step N sends the last rank a
SIGTERM at the start of the step after N steps done (a preemption) and --term-again-in-save a
second one in the save that follows, after its shard files are written and ECHO_S seconds after
the first (a repeat sooner counts as the same one): the stop without saving. --linger-after-stop S:
rank 0 takes S seconds more to leave after a signal stopped the run (a slow teardown), so that
torchrun's agent, seeing another rank exit first, signals it while it leaves. The exit status
is `memfit train`'s.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from memfit.cli import parse_config, train
from memfit.cli._preempt import ECHO_S, Preempted
from memfit.testing import end_process_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fail-at-step", type=int)
    p.add_argument("--fail-in-save", type=int)
    p.add_argument("--term-at-step", type=int)
    p.add_argument("--term-again-in-save", action="store_true")
    p.add_argument("--linger-after-stop", type=float, default=0.0)
    ours, flags = p.parse_known_args()
    cfg = parse_config(["train", *flags])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def doomed() -> bool:
        return first_attempt and dist.get_rank() == dist.get_world_size() - 1

    termed: list[int] = []  # the step --term-at-step signalled at

    def on_step(step: int) -> None:
        if step == ours.fail_at_step and doomed():
            os.kill(os.getpid(), signal.SIGKILL)
        if step == ours.term_at_step and doomed():
            termed.append(step)
            os.kill(os.getpid(), signal.SIGTERM)

    if ours.fail_in_save is not None:
        write_data, saves = dcp.FileSystemWriter.write_data, itertools.count(1)

        def write_then_die(self, plan, planner):
            written = write_data(self, plan, planner)
            written.wait()  # this rank's shards are on disk
            if next(saves) == ours.fail_in_save and doomed():
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        dcp.FileSystemWriter.write_data = write_then_die

    if ours.term_again_in_save:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_term(self, plan, planner):
            written = write_data(self, plan, planner)
            written.wait()
            if termed and doomed():
                time.sleep(ECHO_S + 0.2)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the signal ends the process before this ends
            return written

        dcp.FileSystemWriter.write_data = write_then_term

    try:
        train(cfg, on_step=on_step)
    except Preempted as e:
        if dist.get_rank() == 0:
            time.sleep(ours.linger_after_stop)
        end_process_group()
        sys.exit(e.status)
    # as `memfit train` does: every process group freed before the interpreter's teardown (See
    # [Note: Ending a process group] in memfit/cli/_launch.py); one still held fails the run
    left = end_process_group()
    if left:
        sys.exit(f"rank {os.environ.get('RANK', '0')}: {', '.join(left)} outlived destroy_process_group()")


if __name__ == "__main__":
    main()
