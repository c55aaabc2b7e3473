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


class Param:
    """A sharded parameter's stand-in: a name and a shard whose ``.grad`` the checks may drop."""

    def __init__(self, fqn: str) -> None:
        self.fqn, self.sharded = fqn, SimpleNamespace(grad=None)


def backward(checks: StepChecks, params, flags, have) -> None:
    """One backward of unit #3 at world size 1 (check sums 3, 9): fresh gradients for
    ``params``, ``flags`` as reduced over the ranks, ``have`` this rank's."""
    for sp in params:
        sp.sharded.grad = torch.zeros(1)
        checks.fresh_grad(sp)
    tail = torch.tensor([*map(float, flags), 3.0, 9.0])
    checks.reduced(SimpleNamespace(index=3, name="layer"), params, tail, exact=True, have=have)
    checks.settle_later()


def test_a_gradient_this_rank_lacks_is_read_at_once_only_the_first_time():
    """Issue 48 bug 3: a step lacking a gradient on this rank read the flags at the end of
    backward (a host sync) every step; now only the first step lacking that set does, and later
    ones apply its outcome at once and check it off the backward."""
    from memfit.testing import device_audit

    used, pooler = Param("used"), Param("pooler")
    checks = StepChecks(rank=0, guess=True)
    for step in range(3):
        with device_audit() as audit:
            backward(checks, [used, pooler], flags=[1, 0], have=(True, False))
        assert audit.host_reads == (1 if step == 0 else 0), step  # the first step's read at once
        assert pooler.sharded.grad is None and used.sharded.grad is not None  # no rank had it
        with device_audit() as audit:
            checks.settle(wait=False)  # the next forward: the started read, checked
        assert audit.host_reads == (0 if step == 0 else 1)


def test_an_outcome_that_changed_warns_and_reads_at_once_from_then_on():
    used, pooler = Param("used"), Param("pooler")
    checks = StepChecks(rank=0, guess=True)
    backward(checks, [used, pooler], flags=[1, 0], have=(True, False))
    backward(checks, [used, pooler], flags=[1, 1], have=(True, False))  # another rank used it now
    with pytest.warns(RuntimeWarning, match=r"dropped the gradients other ranks gave \['pooler'\]"):
        checks.settle(wait=False)
    backward(checks, [used, pooler], flags=[1, 1], have=(True, False))
    assert pooler.sharded.grad is not None and checks._started == []  # read at once: another rank had it


def test_by_default_a_lacking_gradient_is_read_at_once_every_step():
    """Without guess=True (the default) no outcome is reused: a parameter another rank used in a
    later step keeps its gradient in that step, never dropped by an earlier step's outcome."""
    from memfit.testing import device_audit

    used, pooler = Param("used"), Param("pooler")
    checks = StepChecks(rank=0)
    for step, flags in enumerate(([1, 0], [1, 0], [1, 1])):
        with device_audit() as audit:
            backward(checks, [used, pooler], flags=flags, have=(True, False))
        assert audit.host_reads == 1, step
        assert (pooler.sharded.grad is None) == (flags[1] == 0), step
    assert checks.lacks([pooler]) is False  # a settled step starts afresh
