"""The disk tier of memfit.host_optimizer at two gloo ranks: the cases of tests/_disk_tier.py
(one spawned group): descriptors closed, files reserved, the step after backward one unit at
a time, gradients on disk, bitwise against the fused optimizer stepped after backward; one
rank runs them in tests/unit/test_disk_tier.py (See [Note: The disk tier])."""

import pytest

from tests._disk_tier import CASES
from tests._dist import Subtests, case_id

GROUP = Subtests(CASES)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("disk-tier"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_two_ranks(root, case):
    GROUP.check(case, 2, root)
