"""The step's checks are read without a host sync (See [Note: Divergence detection]): the
root's forward reads the last backward's checks only once their copy to the host has landed
(an event's query), waits only for a read two backwards old, and still raises on divergence.
CUDA events are stood in for by an object with the same two methods."""

from types import SimpleNamespace

import pytest
import torch

from memfit._shard._checks import StepChecks, _packed


class Event:
    """A CUDA event's query/synchronize, counted."""

    def __init__(self) -> None:
        self.landed = False
        self.waits = 0

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.waits += 1
        self.landed = True


def started(checks: StepChecks, sent: float, event: Event, index: int = 3) -> None:
    """A read in flight, as settle_later leaves it on a GPU: ranks sent unit ``sent``."""
    unit = SimpleNamespace(index=index, name="layer")
    ids = torch.tensor([float(sent)])
    checks._started.append(([(unit, ids)], [], _packed([ids]), event))


def test_forward_reads_a_landed_copy_without_waiting_and_raises_on_divergence():
    checks, event = StepChecks(rank=0), Event()
    started(checks, sent=5, event=event)  # diverged: the unit is #3
    checks.settle(wait=False)  # not landed: left in flight, nothing waited for
    assert event.waits == 0 and len(checks._started) == 1
    event.landed = True
    with pytest.raises(RuntimeError, match="ranks diverged"):
        checks.settle(wait=False)
    assert event.waits == 0 and checks._started == []


def test_only_a_read_two_backwards_old_is_waited_for():
    checks, old, new = StepChecks(rank=0), Event(), Event()
    started(checks, sent=3, event=old)
    checks.settle_later()  # the end of the next backward (nothing recorded): keeps both in flight
    assert old.waits == 0
    started(checks, sent=3, event=new)
    checks.settle(wait=False)  # the older one must land now; the newer stays in flight
    assert (old.waits, new.waits, len(checks._started)) == (1, 0, 1)
    checks.settle()  # waiting (evaluation, debugging): everything
    assert new.waits == 1 and checks._started == []


def test_a_read_in_flight_keeps_no_view_of_the_reduce_output():
    """A unit's reduce tail views its whole reduce output; the read started at the end of
    backward keeps the tail's size and dtype only, so the output (the gradient shards, once
    zero_grad drops them) is not held until the read lands, which on a GPU may be after the
    next forward and backward. Checked, it still raises on divergence."""
    from torch.multiprocessing.reductions import StorageWeakRef

    checks = StepChecks(rank=0)
    out = torch.zeros(1000)
    out[-2:] = torch.tensor([3.0, 9.0])  # unit #3's check sums i and i * i (world size 1)
    unit = SimpleNamespace(index=3, name="layer")
    checks.reduced(unit, [], out[-2:], exact=True)
    checks.settle_later()
    output = StorageWeakRef(out.untyped_storage())
    del out
    assert output.expired() and len(checks._started) == 1
    checks.settle()  # reads the packed copy: unit #3 reduced, as recorded
    assert checks._started == []
    checks.reduced(unit, [], torch.tensor([5.0, 25.0]), exact=True)  # another unit's sums
    checks.settle_later()
    with pytest.raises(RuntimeError, match="ranks diverged"):
        checks.settle()
