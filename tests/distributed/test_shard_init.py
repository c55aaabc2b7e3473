"""Deferred initialisation: build on the meta device, shard, then fill only the local chunks."""

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit.testing import sharded_units as units_of
from tests._dist import Subtests, case_id
from tests._models import MLP


def on_meta():
    with torch.device("meta"):
        torch.manual_seed(0)
        model = MLP()
        model.norm = nn.BatchNorm1d(3)  # a module with buffers, built on meta too
    return model


def digest(model):
    h = hashlib.sha256()
    with memfit.summon_full_params(model, writeback=False):
        for n, p in model.named_parameters():
            h.update(n.encode() + p.detach().clone().numpy().tobytes())
    return h.hexdigest()


def case_materialize_peak_and_values(rank, world):
    model = on_meta()
    with memfit.MemoryMeter() as meter:
        model = memfit.FullyShardedDataParallel(model, auto_wrap_policy=nn.Sequential)
        memfit.materialize(model, seed=3)
    units = units_of(model)
    local = sum(p.numel() * 4 for p in model.parameters())  # this rank's chunks (about P/W)
    # One unit in full, as allocated: with the padding rows of the last slots (W * c rows).
    largest = max(sum(sp.padded_numel for sp in u.params) for u in units) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert meter.peak_bytes <= local + largest + buffers, (meter.peak_bytes, local, largest)
    # Every rank computed the same full values (same seed), and reset_parameters ran.
    digests = [None] * world
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1
    with memfit.summon_full_params(model, writeback=False):
        w = model.blocks[0][0].weight
        bound = 1 / 13**0.5  # nn.Linear's init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert w.abs().max() <= bound and w.abs().max() > bound / 2
        assert torch.equal(model.norm.running_var, torch.ones(3))  # BatchNorm's reset
    x = torch.randn(4, 6)
    model(x).sum().backward()  # trains
    assert model.inp.weight.grad is not None


def case_forward_before_materialize_is_refused(rank, world):
    model = memfit.FullyShardedDataParallel(on_meta(), auto_wrap_policy=nn.Sequential)
    with pytest.raises(RuntimeError, match=r"built on the meta device .* memfit\.materialize"):
        model(torch.randn(2, 6))


def case_streamed_load_from_rank_0(rank, world):
    torch.manual_seed(5)
    plain = MLP()
    model = memfit.FullyShardedDataParallel(on_meta_mlp(), auto_wrap_policy=nn.Sequential)
    with memfit.MemoryMeter() as meter:
        memfit.load_full_state_dict(model, plain.state_dict() if rank == 0 else None)
    with memfit.summon_full_params(model, writeback=False):
        for n, p in model.named_parameters():
            assert torch.equal(p, dict(plain.named_parameters())[n]), n
    largest_param = max(p.numel() for p in plain.parameters()) * 4
    local = sum(p.numel() * 4 for p in model.parameters())
    if rank != 0:  # rank 0 also holds the state dict it was given
        assert meter.peak_bytes <= local + largest_param, (meter.peak_bytes, local, largest_param)
    bad = {k: v for k, v in plain.state_dict().items() if k != "out.bias"}
    bad["out.weight"] = torch.zeros(4, 13)
    with pytest.raises(RuntimeError, match=r"missing keys \['out.bias'\].*'out.weight' is \[4, 13\]"):
        memfit.load_full_state_dict(model, bad if rank == 0 else None)


def on_meta_mlp():
    with torch.device("meta"):
        return MLP()


def case_cpu_offload_logic(rank, world):
    # On this machine the compute device is the CPU too: this checks the offload paths (host
    # shards, gradients returned to the host, optimizer on the host) give the same training;
    # the memory saving needs an accelerator.
    results = []
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = memfit.FullyShardedDataParallel(MLP(), auto_wrap_policy=nn.Sequential, offload=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
        results.append(digest(model))
    assert results[0] == results[1]
    with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
        memfit.shard(MLP(), offload="disk")


CASES = [
    case_materialize_peak_and_values,
    case_forward_before_materialize_is_refused,
    case_streamed_load_from_rank_0,
    case_cpu_offload_logic,
]
GROUP = Subtests(CASES)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deferred_init(world, case):
    GROUP.check(case, world)
