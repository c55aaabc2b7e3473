"""The spawned-gloo test helper reports failures and never hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import Subtests, run_ranks, run_subtests


def allreduce_rank(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def hang_on_rank_0(rank, world):
    dist.barrier()  # both ranks are up: rank 1 finishes at once, however slow the start was
    if rank == 0:
        time.sleep(600)


def case_ok(rank, world, *args):
    assert dist.get_world_size() == world


def case_fails(rank, world, *args):
    assert rank == 0, "only rank 0 passes"


def case_with_args(rank, world, tag, n):
    assert (tag, n) == ("x", 3)


def case_dies_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)


def test_results_and_failures_in_one_group():
    assert run_ranks(allreduce_rank, 3) == [3.0, 3.0, 3.0]
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_ranks(fail_on_rank_1, 2)


def test_stuck_rank_is_killed_and_named():
    start = time.monotonic()
    # 45 s for both ranks to start and meet (20 s was too short with 7 jobs on 2 cores: rank 1
    # was named too); rank 0 would sleep 600 s, so returning well before is the kill.
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not finish within 45s"):
        run_ranks(hang_on_rank_0, 2, timeout=45)
    assert time.monotonic() - start < 300


def test_subtests_report_per_case():
    report = run_subtests([case_ok, case_fails], 2)
    assert report["case_ok"] is None
    assert "rank 1:" in report["case_fails"] and "only rank 0 passes" in report["case_fails"]
    assert "rank 0:" not in report["case_fails"]


def test_one_group_per_world_size_and_a_failed_group_fails_every_case():
    group = Subtests([case_ok, case_fails, case_with_args])
    group.check(case_ok, 2, "x", 3)
    group.check(case_with_args, 2, "x", 3)
    assert group.report(2, "x", 3) is group.report(2, "x", 3)  # spawned once, read by every case
    with pytest.raises(pytest.fail.Exception, match="only rank 0 passes"):
        group.check(case_fails, 2, "x", 3)
    dying = Subtests([case_dies_on_rank_1, case_ok])
    for case in dying.cases:
        with pytest.raises(pytest.fail.Exception, match=r"group of 2 ranks failed as a whole: rank [01] "):
            dying.check(case, 2)
