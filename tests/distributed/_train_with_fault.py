"""`memfit train` with a rank that dies: the entry point tests/test_train.py launches with
python or torchrun in place of `-m memfit train`.

    _train_with_fault.py --fail-at-step N [memfit train flags]

The last rank kills itself with SIGKILL (as a crash or the OOM killer would: no clean-up, no
exit handler) at the start of the step after N steps done, on torchrun's first attempt only,
so that the restarted job runs through. The fault comes in through train's ``on_step`` hook.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch.distributed as dist

from memfit.cli import parse_config, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fail-at-step", type=int, required=True)
    ours, flags = p.parse_known_args()
    cfg = parse_config(["train", *flags])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def on_step(step: int) -> None:
        if step == ours.fail_at_step and first_attempt and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    train(cfg, on_step=on_step)


if __name__ == "__main__":
    main()
