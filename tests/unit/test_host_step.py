"""memfit.host_optimizer at one rank (a gloo group of one, in this process): the cases of
tests/_host_step.py, bitwise against the fused optimizer stepped after backward; and the
stream trace of the host step at two simulated ranks on the meta test device (See [Note:
The host step]). The two-rank parity runs in tests/distributed/test_host_step.py.

Only a GPU shows the worker's wait on the copy's event and the overlap with device compute."""

import pytest
import torch

import memfit
from memfit.testing import meta_accelerator, sharded_units, trace_streams
from tests._dist import case_id
from tests._host_step import CASES
from tests.unit.test_stream_rules import backward, sharded_net


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.filterwarnings("ignore:memfit.host_optimizer")
def test_one_rank(one_rank, tmp_path, case):
    case(0, 1, str(tmp_path))


@pytest.mark.filterwarnings("ignore:memfit.host_optimizer")
def test_each_unit_steps_on_the_host_after_its_reduce_and_before_the_backward_ends():
    """Offloaded shards at two ranks: each unit's step waits for its post-reduce event, runs
    while the units before it still compute their backward (their reduce-scatters come after
    it in the log), and compute waits for the steps at the end of backward, before it reads
    the gradient shards."""
    with meta_accelerator(2), trace_streams() as trace:
        model = sharded_net(offload="cpu")
        opt = memfit.host_optimizer(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        for _ in range(2):
            backward(model)
            opt.step()
            opt.zero_grad()
    log = trace.log
    assert trace.violations() == []
    steps = [i for i, e in enumerate(log) if e[0] == "use" and e[2] == "host"]
    assert len(steps) == 2 * 3 and opt._memfit_host_step.steps_in_backward == 6
    # the first backward: the last unit in forward (the root's Linear) steps first, then the others
    first = steps[:3]
    names = [log[i][1].removesuffix(":grad-shards") for i in first]
    assert len(set(names)) == 3
    for i, name in zip(first[:-1], names[:-1]):  # a later unit's reduce-scatter follows this step
        later = [e for e in log[i:] if e[0] == "alloc" and e[1].endswith(":reduce-out")]
        assert later and not later[0][1].startswith(name), (name, later[:1])
    ends = [i for i, e in enumerate(log) if e[0] == "use" and e[1].endswith(":grad-shards") and e[2] == "compute"]
    assert max(first) < min(ends)  # every step before compute reads the gradient shards


def test_warns_once_and_refuses_what_it_cannot_step(one_rank):
    model = memfit.shard(torch.nn.Linear(4, 4), offload="cpu")
    with pytest.warns(UserWarning, match="Adagrad with fused=True") as said:
        memfit.host_optimizer(model, torch.optim.Adagrad(model.parameters()))
    assert len(said) == 1
    with pytest.raises(ValueError, match="LBFGS steps with a closure"):
        memfit.host_optimizer(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        memfit.host_optimizer(model, object())  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:memfit.host_optimizer")
def test_the_first_units_of_the_next_forward_are_packed_ahead():
    """On an accelerator (the meta test device here) the host step packs the stepped shards of
    the next forward's first two units into host memory laid out as their send slots (pinned
    on a GPU): their gathers then copy across without packing (copy_in is not called)."""
    from unittest import mock

    from memfit._shard import _unit

    with meta_accelerator(2):
        model = sharded_net(offload="cpu")
        opt = memfit.host_optimizer(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        packs = []
        for _ in range(3):
            with mock.patch.object(_unit, "copy_in", side_effect=_unit.copy_in) as spy:
                out = model(torch.randn(3, 4, device="meta"))
            packs.append(spy.call_count)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        host = opt._memfit_host_step
        assert host.staged_units == 3 * 2
        assert packs == [3, 1, 1]  # three units gather in forward; after a step two are packed already
        root = sharded_units(model)[0]
        assert root.staged is not None and root.staged[0].shape == (root._gather_plan.slot,)
        clipped = sharded_net(offload="cpu")  # steps after backward (max_norm): packed at optimizer.step()
        opt = memfit.host_optimizer(clipped, torch.optim.AdamW(clipped.parameters(), lr=0.1), max_norm=1.0)
        for _ in range(2):
            backward(clipped)
            opt.step()
        assert (opt._memfit_host_step.staged_units, opt._memfit_host_step.steps_in_backward) == (2 * 2, 0)
