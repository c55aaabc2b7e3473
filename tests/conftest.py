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
