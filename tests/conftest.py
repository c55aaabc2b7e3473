import os

import pytest
import torch

# MEMFIT_TEST_DEVICE=cuda: the sharding cases that take their device from tests._dist.test_device()
# run on CUDA with NCCL (see docs/devices.md); the default is the CPU with gloo.
DEVICE = os.environ.get("MEMFIT_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"MEMFIT_TEST_DEVICE={DEVICE!r}: use cpu (default) or cuda")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter, config):
    """With --durations=N: the N slowest sub-cases of the spawned groups (tests._dist.Subtests),
    whose whole group's time pytest books to the group's first test."""
    n = config.getoption("durations", None)
    from tests._dist import CASE_SECONDS

    if not n or not CASE_SECONDS:
        return
    terminalreporter.write_sep("=", f"slowest {n} sub-cases of spawned groups (rank 0, seconds)")
    for (world, name), s in sorted(CASE_SECONDS.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{s:8.2f}s  W={world}  {name}")
