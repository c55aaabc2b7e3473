"""Sharding over one rank ([Note: One rank computes on its shards]): a unit computes on its
parameters as they are, as FSDP2 does at world size 1, so a step issues no collective and no
copy beyond plain torch's, gives plain torch's results bitwise, and peaks where plain torch
peaks (the planner's s = 1 terms). One process, a gloo group of one.

Only a GPU shows that no kernel and no stream wait is issued there either (counted here as
dispatched aten ops, which is what a launch is on CUDA).
"""

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.testing import HostSyncCounter, OpCounter, sharded_units


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def sharded(model, **kw):
    for i in (0, 2, 4):
        memfit.shard(model[i], **kw)
    return memfit.shard(model, **kw)


def step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


# c10d ops and copies a sharded step may add to plain torch's: none at one rank.
_MOVES = ("copy_", "_foreach_copy_", "split_with_sizes_copy", "_chunk_cat", "cat", "clone")


def test_one_rank_issues_no_collective_and_no_copy(one_rank):
    plain, model = net(), sharded(net())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    x = torch.randn(5, 8)
    for m, o in zip((plain, model), opts):
        step(m, o, x)  # the first step records the order
    counted = []
    for m, o in zip((plain, model), opts):
        with OpCounter() as ops:
            step(m, o, x)
        counted.append(ops)
    base, got = counted
    collectives = {k: v for k, v in got.ops.items() if k.startswith(("_allgather", "_reduce_scatter", "allreduce"))}
    assert collectives == {} and got.wire_bytes == 0
    assert {k: got.kernels[k] for k in _MOVES if got.kernels[k]} == {
        k: base.kernels[k] for k in _MOVES if base.kernels[k]
    }
    assert got.launches == base.launches, (got.kernels - base.kernels, base.kernels - got.kernels)


@pytest.mark.parametrize("no_sync", [False, True])
def test_one_rank_matches_plain_torch_bitwise(one_rank, no_sync):
    plain = net()
    model = sharded(copy.deepcopy(plain))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8)
        if no_sync:  # accumulate over two backwards, as plain torch does without zero_grad
            with model.no_sync():
                model(x).sum().backward()
            plain(x).sum().backward()
        losses = [step(m, o, x) for m, o in zip((plain, model), opts)]
        assert torch.equal(*losses)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert all(sp.direct for u in sharded_units(model) for sp in u.params)


def test_one_rank_peaks_where_plain_torch_peaks(one_rank):
    """The planner forecasts one shard as one process (no gather or reduce buffers)."""
    plain, model = net(), sharded(net())
    x = torch.randn(5, 8)
    peaks = []
    for m in (plain, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        step(m, opt, x)
        with memfit.MemoryMeter(device="cpu", model=m, optimizer=opt) as meter:
            step(m, opt, x)
        peaks.append(meter.peak_bytes)
    assert peaks[0] == peaks[1]


def test_one_rank_state_dict_materialize_and_summon(one_rank):
    """Outside the step the chunk still reads as the full parameter: state dicts, deferred
    init and summon_full_params (whose writes land in the parameter)."""
    model = sharded(net().to("meta"))
    memfit.materialize(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with memfit.summon_full_params(model):
        model[0].weight.data.fill_(2.0)
    assert torch.equal(model[0].weight, torch.full((16, 8), 2.0))
    with memfit.summon_full_params(model, writeback=False):
        model[0].weight.data.fill_(3.0)
    assert torch.equal(model[0].weight, torch.full((16, 8), 2.0))  # discarded, as at any world size
    keys = set(model.state_dict())
    assert {"0.weight", "4.bias"} <= keys


def test_one_rank_with_mixed_precision_casts_but_calls_no_collective(one_rank):
    """bf16 compute from fp32 shards needs the cast (a copy); the collectives are still skipped."""
    mp = memfit.MixedPrecision(torch.bfloat16)
    model = sharded(net(), mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    step(model, opt, x)
    with OpCounter() as ops:
        step(model, opt, x)
    assert not any(k.startswith(("_allgather", "_reduce_scatter", "allreduce", "alltoall")) for k in ops.ops)
    norm = sharded_units(model)[0].params  # the root holds the fp32 LayerNorm's: no cast, on the chunk
    assert {sp.direct for sp in norm} == {True}


def test_one_rank_mixed_precision_step_reads_nothing_back_and_casts_once_per_gather(one_rank):
    """bf16 compute at one rank (benchmarks/sharding_host_overhead.py): with no rank to diverge
    from, the step records no checks and reads nothing back to the host (the old runtime read
    the step's checks at the next root forward: one host sync per step on a GPU); a gather is
    one cast of the chunks into the full tensors and a reduce one cast of the gradients into
    the chunks' .grad, whatever the number of parameters: no gather or reduce buffer, no
    index tail, no split-copy."""
    mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    model = sharded(net(), mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    for _ in range(2):
        step(model, opt, x)
    for _ in range(2):
        with HostSyncCounter() as syncs, OpCounter() as ops:
            step(model, opt, x)
        assert syncs.calls == [], syncs.calls
        # three Linear units, gathered for forward and again for backward, reduced once; the
        # root holds only the fp32 LayerNorm, which computes on its chunk (no cast)
        assert ops.kernels["_foreach_copy_"] == 6, ops.kernels
        assert ops.kernels["_chunk_cat"] == 3, ops.kernels
        moves = ("split_with_sizes_copy", "copy_", "cat", "clone")
        assert {k: ops.kernels[k] for k in moves if ops.kernels[k]} == {}, ops.kernels
        assert ops.ops["empty"] == 3, ops.ops  # one flat gradient buffer per reduce


def _through_buffers(model):
    """The same model on the runtime's general path (buffers and the step's checks), as
    offloaded chunks and HSDP take it at one rank: the reference the local casts must match."""
    for u in sharded_units(model):
        u._local = False
    return model


@pytest.mark.parametrize("case", ["plain", "no_sync", "unused", "keep_grads"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_one_rank_mixed_precision_local_casts_match_the_buffered_path_bitwise(one_rank, case, reduce_dtype):
    mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=reduce_dtype)
    base = net()
    fast = sharded(copy.deepcopy(base), mixed_precision=mp)
    ref = _through_buffers(sharded(copy.deepcopy(base), mixed_precision=mp))
    if case == "unused":  # a parameter no forward uses: its .grad stays None
        for m in (fast, ref):
            m[2].spare = nn.Parameter(torch.ones(3))
    models = (fast, ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8)
        if case == "no_sync":  # accumulated in fp32 (the reduce dtype) between the backwards
            for m in models:
                with m.no_sync():
                    m(x).sum().backward()
        losses = []
        for m, o in zip(models, opts):
            loss = m(x).square().mean()
            loss.backward()
            if case == "keep_grads":  # a second backward adds into the chunks' .grad
                m(x).sum().backward()
            o.step()
            o.zero_grad(set_to_none=case != "keep_grads")
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), name
    cast = [u for u in sharded_units(fast) if u._copied()]  # the root holds only the fp32 norm
    assert len(cast) == 3 and all(u._local for u in cast)
