"""The sharding hot path at GPU grade, counted on gloo ranks: host syncs per step, kernel
launches per unit, bytes on the wire, and the order of stream waits and buffer frees.

On a CPU nothing waits and nothing runs asynchronously, so what these tests hold is counted,
not timed: each ``.item()`` here would stop the host on an accelerator, each op a launch.
"""

import copy

import pytest
import torch
from torch import nn

import memfit
import memfit.testing
from memfit.testing import HostSyncCounter, OpCounter, Trace, trace_streams
from tests._dist import Subtests, case_id


class Bag(nn.Module):
    """A unit of ``k`` parameters of uneven sizes (the counts must not depend on ``k``)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 8)
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(i % 5 + 1, 3)) for i in range(k - 1)])

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        for p in self.extra:
            h = h + p.mean()
        return h


class NormBag(Bag):
    """A Bag ending in a LayerNorm: under mixed precision its unit mixes bf16 and fp32 chunks."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(super().forward(x))


class Net(nn.Module):
    def __init__(self, units: int, k: int, bag: type = Bag) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = nn.Sequential(*[bag(k) for _ in range(units)])
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.bags(x))


def aligned(n: int, itemsize: int) -> int:
    """``n`` elements of ``itemsize`` bytes rounded up to a multiple of 16 bytes (a slot's size)."""
    per = 16 // itemsize
    return -(-n // per) * per


def step(model, x):
    model(x).square().mean().backward()


def sharded(units, k, bag=Bag, **kwargs):
    plain = Net(units, k, bag)
    return plain, memfit.FullyShardedDataParallel(copy.deepcopy(plain), auto_wrap_policy=Bag, **kwargs)


def launches(model, x) -> int:
    with OpCounter() as ops:
        step(model, x)
    return ops.launches


# Launches per unit and step (fp32, reshard after forward; the root keeps its parameters):
PER_GATHER = 3  # copy-in into this rank's slot of the output, the all-gather, the split-copy out
# Gradient copy-in (flags included), the reduce-scatter, on gloo the add of this rank's own slice
# (2 ranks) or the copy of its summed slice (more) into the output at wait (NCCL writes the
# output itself; FSDP2 on gloo shows the copy, made by gloo), the division by W.
PER_REDUCE = 4
PER_UNIT = 2 * PER_GATHER + PER_REDUCE  # gathered for forward and again for backward, reduced once
# The root: one gather (it keeps its parameters for backward), one reduce; the step's one read
# of the checks: a concatenation and a cast per dtype (one here), whatever the number of units.
PER_STEP_FIXED = PER_GATHER + PER_REDUCE + 2


def case_at_most_one_host_sync_per_step(rank, world):
    for units in (4, 12):
        _, model = sharded(units, 3)
        x = torch.randn(4, 8)
        step(model, x)  # the first step records the order
        for _ in range(2):
            with HostSyncCounter() as syncs:
                step(model, x)
                for p in model.parameters():
                    p.grad = None
            # the previous step's checks, read at the root's forward: none while backward runs
            assert syncs.count <= 1 and syncs.in_backward == [], (units, syncs.calls, syncs.in_backward)


def case_launches_per_unit_independent_of_params_and_world(rank, world):
    x = torch.randn(4, 8)
    units = 4
    for k in (2, 20):
        plain, model = sharded(units, k)
        for m in (plain, model):
            step(m, x)
            m.zero_grad()
        extra = launches(model, x) - launches(plain, x)
        assert extra == units * PER_UNIT + PER_STEP_FIXED, (k, world, extra)


def case_mixed_precision_launches_independent_of_params(rank, world):
    # Issue 23 point 9: bf16 layers beside fp32 norms in one unit travel on a byte wire; the
    # copy-in groups the chunks by dtype (one foreach copy each, CUDA's fast path) and the
    # reduce copy-in is torch._chunk_cat per gradient dtype: no launch per parameter.
    mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    x = torch.randn(4, 8)
    extra = {}
    for k in (2, 20):
        plain, model = sharded(4, k, NormBag, mixed_precision=mp)
        for m in (plain, model):
            step(m, x)
            m.zero_grad()
        extra[k] = launches(model, x) - launches(plain, x)
    assert extra[2] == extra[20], (world, extra)


def case_gloo_reduce_without_gloos_clone(rank, world):
    # gloo's reduce_scatter_tensor clones its whole input on the calling thread and
    # all-reduces the clone (2 (W-1)/W of the input on the wire). memfit, on 2 ranks, sends the
    # other rank its slice straight into the output (an all-to-all: (W-1)/W, as NCCL's ring);
    # on more, it all-reduces its own send buffer in place. (An all-to-all all-gather would
    # save gloo's copy of the output too, but on ranks that diverge it pairs collectives of
    # different sizes where gloo's all-gather did not, and gloo aborts the process there.)
    units = 4
    _, model = sharded(units, 3)
    x = torch.randn(4, 8)
    step(model, x)
    model.zero_grad()
    stats = memfit.testing.collective_stats()
    stats.reset()
    with OpCounter() as ops:
        step(model, x)
    reduces, gathers = units + 1, 2 * units + 1  # blocks gathered for forward and backward, the root once
    assert ops.ops["alltoall_base_" if world == 2 else "allreduce_"] == reduces, ops.ops
    assert ops.ops["_allgather_base_"] == gathers
    assert ops.ops["_reduce_scatter_base_"] == 0
    assert "clone" not in ops.ops
    slots = [
        world * aligned(sum(p.slot_numel + 1 for p in u.params) + 2, 4) for u in memfit.testing.sharded_units(model)
    ]
    reduced = (1 if world == 2 else 2) * 4 * sum(slots) * (world - 1) / world
    assert ops.wire_bytes == pytest.approx(stats.all_gather_bytes + reduced)  # counts through float (W-1)/W


def case_unused_parameter_still_keeps_no_grad(rank, world):
    _, model = sharded(4, 3)
    model.spare = nn.Linear(2, 2)
    x = torch.randn(4, 8)
    model.bags[1].extra[0].requires_grad_(True)
    with HostSyncCounter() as syncs:
        step(model, x)
    assert syncs.count <= 1
    assert model.bags[0].w.grad is not None
    for p in model.spare.parameters():
        assert p.grad is None


class Branches(nn.Module):
    """A unit whose ``b`` runs on rank 0 only and whose ``spare`` runs nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) if torch.distributed.get_rank() == 0 else h


def case_unused_gradients_as_ddp_without_a_sync_in_backward(rank, world):
    """Issue 48: a rank lacking a gradient made the host wait at the end of backward. Now
    nothing waits in backward and the optimizer step settles it (one read): against DDP
    (find_unused_parameters=True) over 3 SGD steps with weight decay, ``b`` (unused on the
    other ranks) gets the reduced gradient and ``spare`` (unused everywhere) stays None."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests._parity import my_rows

    torch.manual_seed(0)
    plain = nn.Sequential(Branches(), nn.LayerNorm(8))
    ddp = DDP(copy.deepcopy(plain), find_unused_parameters=True)
    model = memfit.FullyShardedDataParallel(copy.deepcopy(plain), auto_wrap_policy=Branches)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, weight_decay=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        step(ddp, x)
        ref_opt.step()
        with HostSyncCounter() as syncs:
            step(model, x)
            opt.step()
        assert syncs.in_backward == [] and syncs.count == 1, (syncs.calls, syncs.in_backward)  # the step's read
        for (n, p), q in zip(model.named_parameters(), ddp.parameters()):
            assert (p.grad is None) == (q.grad is None) == n.startswith("0.spare"), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad.reshape(-1), my_rows(q.grad, rank, world).reshape(-1))
            torch.testing.assert_close(p.detach().reshape(-1), my_rows(q.detach(), rank, world).reshape(-1))
        opt.zero_grad()
        ref_opt.zero_grad()


def case_wire_bytes_one_dtype_per_unit(rank, world):
    mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)

    class Block(nn.Module):  # a Linear in bf16 and a LayerNorm kept in fp32: two compute dtypes
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.lin(x))

    torch.manual_seed(0)
    model = memfit.FullyShardedDataParallel(
        nn.Sequential(*[Block() for _ in range(3)]), auto_wrap_policy=Block, mixed_precision=mp
    )
    x = torch.randn(4, 8)
    step(model, x)
    stats = memfit.testing.collective_stats()
    stats.reset()
    step(model, x)
    ring = (world - 1) / world
    units = [u for u in memfit.testing.sharded_units(model) if u.params]
    # Per gathered unit: W slots of every parameter's padded chunk in its compute dtype (bf16
    # for the Linear, fp32 for the LayerNorm), then the unit index padded to 16 bytes.
    slot = {u: sum(p.slot_numel * p.full.element_size() for p in u.params) for u in units}
    slot = {u: aligned(b + 1, 1) for u, b in slot.items()}
    gathered_twice = units  # forward and backward (all are blocks: the root holds none)
    assert stats.all_gather_bytes == sum(2 * world * slot[u] * ring for u in gathered_twice)
    # Nothing travels wider than its compute dtype: at most 16 bytes per slot above the
    # parameters' own bytes in bf16/fp32.
    compute_bytes = sum(p.numel() * p.element_size() for u in units for p in (sp.full for sp in u.params))
    assert stats.all_gather_bytes <= 2 * (compute_bytes + world * 16 * len(units)) * ring + 1e-9 or world == 1
    # Reduce-scatter in reduce_dtype (fp32): every gradient's padded chunk, a flag each, two
    # checks, padded to 16 bytes.
    reduce = sum(world * aligned(sum(p.slot_numel + 1 for p in u.params) + 2, 4) * 4 * ring for u in units)
    assert stats.reduce_scatter_bytes == reduce


def case_stream_order_holds(rank, world):
    _, model = sharded(4, 3)
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trace_streams() as trace:
        for _ in range(3):
            step(model, x)
            opt.step()
            opt.zero_grad()
    kinds = {e[0] for e in trace.log}
    assert {"record", "wait", "alloc", "use", "free"} <= kinds
    assert trace.violations() == []


CASES = [
    case_at_most_one_host_sync_per_step,
    case_launches_per_unit_independent_of_params_and_world,
    case_mixed_precision_launches_independent_of_params,
    case_gloo_reduce_without_gloos_clone,
    case_unused_parameter_still_keeps_no_grad,
    case_unused_gradients_as_ddp_without_a_sync_in_backward,
    case_wire_bytes_one_dtype_per_unit,
    case_stream_order_holds,
]
GROUP = Subtests(CASES)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hot_path(world, case):
    GROUP.check(case, world)


def test_trace_catches_a_buffer_freed_before_its_consumer():
    trace = Trace()
    trace.log = [
        ("alloc", "out", "gather"),
        ("record", "gather", 0),
        ("wait", "compute", 0),
        ("use", "out", "compute"),
        ("free", "out", "gather"),  # the gather stream never waited for the copy-out
    ]
    assert len(trace.violations()) == 1
    trace.log[4:4] = [("record", "compute", 1), ("wait", "gather", 1)]
    assert trace.violations() == []
    trace.log.insert(2, ("use", "out", "compute"))  # a use before compute waited for the gather
    assert len(trace.violations()) == 1
