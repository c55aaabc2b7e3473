"""The step's checks are read without a host sync (See [Note: Divergence detection]): the
root's forward reads the last backward's checks only once their copy to the host has landed
(an event's query), waits only for a read two backwards old, and still raises on divergence.
CUDA events are stood in for by an object with the same two methods."""

import weakref
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
    checks._started.append(([(unit, ids)], [], _packed([ids]), event, {}))


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
        self.fqn, self.sharded = fqn, torch.nn.Parameter(torch.ones(1))


def backward(checks: StepChecks, params, flags, have) -> None:
    """One backward of unit #3 at world size 1 (check sums 3, 9): gradients for ``params``
    (fresh where they had none), ``flags`` as reduced over the ranks, ``have`` this rank's."""
    for sp in params:
        if sp.sharded.grad is None:
            sp.sharded.grad = torch.zeros(1)
            checks.fresh_grad(sp)
    tail = torch.tensor([*map(float, flags), 3.0, 9.0])
    checks.reduced(SimpleNamespace(index=3, name="layer"), params, tail, exact=True, have=have)
    checks.settle_later()


def sgd(params):
    """An SGD whose step would move a parameter with a zero gradient (weight decay)."""
    return torch.optim.SGD([sp.sharded for sp in params], lr=0.5, weight_decay=0.5)


def test_a_gradient_this_rank_lacks_is_settled_at_the_optimizer_step_not_in_backward():
    """Issue 48: a step lacking a gradient on this rank read the flags at the end of backward
    (a host sync) every step. Now backward reads nothing; the optimizer's step pre-hook reads
    once and drops the gradient no rank had, so the step skips that parameter as torch does."""
    from memfit.testing import device_audit

    used, pooler = Param("used"), Param("pooler")
    opt, checks = sgd([used, pooler]), StepChecks(rank=0)
    for step in range(3):
        with device_audit() as audit:
            backward(checks, [used, pooler], [1, 0], (True, False))
        assert audit.host_reads == 0, step  # nothing read in backward
        assert pooler.sharded.grad is not None and list(checks.undecided) == [pooler]
        with device_audit() as audit:
            opt.step()
        assert audit.host_reads == 1, step  # the step's one read, before the update
        assert pooler.sharded.grad is None and used.sharded.grad is not None
        assert torch.equal(pooler.sharded.detach(), torch.ones(1))  # skipped, as an unused parameter
        opt.zero_grad()
    with device_audit() as audit:
        backward(checks, [used, pooler], [1, 0], (True, True))  # every gradient here: nothing to settle
        opt.step()
    assert audit.host_reads == 0 and pooler.sharded.grad is not None


def test_another_ranks_gradient_is_kept_in_every_step_and_across_accumulation():
    """The outcome of an earlier step is never reused: a parameter another rank used keeps its
    reduced gradient in that step; with accumulation, in any backward since it was created."""
    used, pooler = Param("used"), Param("pooler")
    opt, checks = sgd([used, pooler]), StepChecks(rank=0)
    for flags in ([1, 0], [1, 1], [1, 0]):
        backward(checks, [used, pooler], flags, (True, False))
        opt.step()
        assert (pooler.sharded.grad is None) == (flags[1] == 0), flags
        opt.zero_grad()
    for first, second in (([1, 1], [1, 0]), ([1, 0], [1, 1]), ([1, 0], [1, 0])):
        backward(checks, [used, pooler], first, (True, False))
        backward(checks, [used, pooler], second, (True, False))  # accumulates into the same gradient
        opt.step()
        assert (pooler.sharded.grad is None) == (first[1] == second[1] == 0), (first, second)
        opt.zero_grad()


def test_a_forward_that_finds_every_read_landed_settles_without_waiting():
    """The next root forward reads a landed copy anyway: it settles the gradients there, so a
    step after it waits for nothing; a gradient dropped by zero_grad meanwhile is left alone."""
    used, pooler = Param("used"), Param("pooler")
    checks = StepChecks(rank=0)
    backward(checks, [used, pooler], [1, 0], (True, False))
    checks.settle(wait=False)
    assert pooler.sharded.grad is None and checks.undecided == {}
    backward(checks, [used, pooler], [1, 0], (True, False))
    pooler.sharded.grad = None  # zero_grad before the read
    backward(checks, [used, pooler], [1, 1], (True, False))  # a new gradient, another rank's
    checks.settle()
    assert pooler.sharded.grad is not None


def test_the_meta_test_device_decides_nothing():
    """No values (the meta test device): the gradients stay as reduced."""
    pooler, checks = Param("pooler"), StepChecks(rank=0)
    pooler.sharded.grad = grad = torch.zeros(1)
    checks.undecided[pooler] = weakref.ref(grad)
    checks._mark_used(None, {})
    checks.settle()
    assert pooler.sharded.grad is grad and checks.undecided == {}
