"""The store each torchrun attempt meets in (memfit.cli._launch.attempt_store): the ranks of an
attempt agree on one fresh prefix even when an earlier attempt's keys are still in the agent's
store, and a rank that never comes is named. Ranks are threads here, the agent's store a TCPStore
server in this process. See [Note: A fresh store for each torchrun attempt]."""

import datetime
import threading
import time

import torch.distributed as dist

from memfit.cli._launch import HOST, attempt_store

WAIT = datetime.timedelta(seconds=20)


def agent_store():
    return dist.TCPStore(HOST, 0, is_master=True, timeout=WAIT, wait_for_workers=False)


def attempt(server, world_size, late=(), timeout=WAIT, absent=()):
    """One attempt: every rank but those in ``absent`` a thread with a client of ``server``; the
    ranks in ``late`` start 0.3 s after the others. Returns each rank's store (None for a rank that
    raised or was absent) and the errors by rank."""
    stores, errors = [None] * world_size, {}

    def rank(r):
        if r in late:
            time.sleep(0.3)
        client = dist.TCPStore(HOST, server.port, is_master=False, timeout=timeout)
        try:
            stores[r] = attempt_store(client, r, world_size, timeout)
        except RuntimeError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stores, errors


def test_each_attempt_meets_under_a_prefix_of_its_own():
    server = agent_store()
    first, errors = attempt(server, 3)
    assert not errors
    first[1].set("peer/1", "the first attempt's address")
    assert all(s.get("peer/1") == b"the first attempt's address" for s in first)  # one prefix for all
    # The restart: rank 0 comes first and finds the dead ranks' hello keys; the live ones come later.
    second, errors = attempt(server, 3, late=(1, 2))
    assert not errors
    second[2].set("peer/2", "x")
    assert all(s.check(["peer/2"]) for s in second)
    assert not any(s.check(["peer/1"]) for s in second)  # nothing of the dead attempt is seen
    # And again with the roles turned: the others first, rank 0 late.
    third, errors = attempt(server, 3, late=(0,))
    assert not errors
    third[0].set("peer/0", "y")
    assert all(s.check(["peer/0"]) for s in third) and not any(s.check(["peer/2"]) for s in third)


def test_a_rank_that_never_comes_is_named():
    server, short = agent_store(), datetime.timedelta(seconds=0.5)
    _, errors = attempt(server, 3, timeout=short, absent=(2,))
    assert errors[0].startswith("memfit: rank 0: rank(s) 2 of 3 did not join this attempt's process group within 0.5 s")
    _, errors = attempt(server, 2, timeout=short, absent=(0,))
    assert errors[1].startswith("memfit: rank 1: rank 0 did not answer within 0.5 s")
    assert "MEMFIT_PG_TIMEOUT" in errors[1]
