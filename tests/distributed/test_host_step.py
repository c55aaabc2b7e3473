"""memfit.host_optimizer at two gloo ranks: the cases of tests/_host_step.py (one spawned
group), each bitwise against the optimizer built with fused=True and stepped after backward,
with accumulation (with and without no_sync), clipping, a checkpoint and a resume; one rank
runs them in tests/unit/test_host_step.py (See [Note: The host step])."""

import pytest

from tests._dist import Subtests, case_id
from tests._host_step import CASES

GROUP = Subtests(CASES)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("host-step"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_two_ranks(root, case):
    GROUP.check(case, 2, root)
