"""Deferred initialisation: build on the meta device, shard, then fill only the local chunks;
and where a sharded model's tensors live (compute device, host offload), on test_device()
(MEMFIT_TEST_DEVICE; device placement without a GPU: tests/unit/test_device_harness.py)."""

import hashlib
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit.testing import sharded_units as units_of
from tests._dist import Subtests, case_id, test_device
from tests._models import MLP


def on_meta():
    with torch.device("meta"):
        torch.manual_seed(0)
        model = MLP()
        model.norm = nn.BatchNorm1d(3)  # a module with buffers, built on meta too
    return model


def values(model):
    """The full parameters on the host, by name."""
    with memfit.summon_full_params(model, writeback=False):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def same_training(a, b):
    """Two trainings' results ((parameters, norms) pairs): bitwise on the CPU; on an accelerator
    the offloaded run's optimizer (and norm) ran on the host, the other's on the device: the same
    arithmetic in another kernel, so fp32 rounding apart."""
    tol = {"rtol": 0, "atol": 0} if test_device().type == "cpu" else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(a, b, **tol)


def digest(model):
    h = hashlib.sha256()
    with memfit.summon_full_params(model, writeback=False):
        for n, p in model.named_parameters():
            h.update(n.encode() + p.detach().cpu().clone().numpy().tobytes())
    return h.hexdigest()


def init_mlp(m):
    """Torch's init, and the 0-dim scale that MLP sets in its constructor (materialize refuses
    to leave it unset: MLP has no reset_parameters)."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    if isinstance(m, MLP):
        m.scale.fill_(1.5)


def case_materialize_peak_and_values(rank, world):
    model = on_meta()
    with memfit.MemoryMeter(device=test_device()) as meter:
        model = memfit.FullyShardedDataParallel(model, auto_wrap_policy=nn.Sequential)
        memfit.materialize(model, init=init_mlp, seed=3)
    units = units_of(model)
    local = sum(p.numel() * 4 for p in model.parameters())  # this rank's chunks (about P/W)
    # One unit in full, as allocated: with the padding rows of the last slots (W * c rows).
    largest = max(sum(sp.padded_numel for sp in u.params) for u in units) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # materialize's check that every tensor was written: a float32 sum and a flag per tensor.
    check = 9 * (max(len(u.params) for u in units) + len(list(model.buffers())))
    assert meter.peak_bytes <= local + largest + buffers + check, (meter.peak_bytes, local, largest)
    # Every rank computed the same full values (same seed), and reset_parameters ran.
    digests = [None] * world
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1
    with memfit.summon_full_params(model, writeback=False):
        w = model.blocks[0][0].weight
        bound = 1 / 13**0.5  # nn.Linear's init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert w.abs().max() <= bound and w.abs().max() > bound / 2
        assert torch.equal(model.norm.running_var.cpu(), torch.ones(3))  # BatchNorm's reset
    x = torch.randn(4, 6, device=test_device())
    model(x).sum().backward()  # trains
    assert model.inp.weight.grad is not None


def case_forward_before_materialize_is_refused(rank, world):
    model = memfit.FullyShardedDataParallel(on_meta(), auto_wrap_policy=nn.Sequential)
    with pytest.raises(RuntimeError, match=r"built on the meta device .* memfit\.materialize"):
        model(torch.randn(2, 6, device=test_device()))


def case_streamed_load_from_rank_0(rank, world):
    torch.manual_seed(5)
    plain = MLP()
    model = memfit.FullyShardedDataParallel(on_meta_mlp(), auto_wrap_policy=nn.Sequential)
    with memfit.MemoryMeter(device=test_device()) as meter:
        memfit.load_full_state_dict(model, plain.state_dict() if rank == 0 else None)
    with memfit.summon_full_params(model, writeback=False):
        for n, p in model.named_parameters():
            assert torch.equal(p.cpu(), dict(plain.named_parameters())[n]), n
    bad = {k: v for k, v in plain.state_dict().items() if k != "out.bias"}
    bad["out.weight"] = torch.zeros(4, 13)
    with pytest.raises(RuntimeError, match=r"missing keys \['out.bias'\].*'out.weight' is \[4, 13\]"):
        memfit.load_full_state_dict(model, bad if rank == 0 else None)
    # Checked after every collective of the case, so that a failure here cannot leave the other
    # rank waiting in one. gloo's worker drops its reference to a broadcast's buffer when it
    # likes: under load the previous tensor was still alive beside the next (the bound failed).
    largest_param = max(p.numel() for p in plain.parameters()) * 4
    local = sum(p.numel() * 4 for p in model.parameters())
    if rank != 0:  # rank 0 also holds the state dict it was given
        assert meter.peak_bytes <= local + largest_param, (meter.peak_bytes, local, largest_param)


def on_meta_mlp():
    with torch.device("meta"):
        return MLP()


def train(model, rank, steps=3, clip=None, micro=1):
    """AdamW steps on rank-dependent data, ``micro`` backwards per step (accumulated), clipped."""
    dev = test_device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(steps):
        for m in range(micro):
            g = torch.Generator().manual_seed(step * 10 + m * 100 + rank)
            x, y = torch.randn(4, 6, generator=g).to(dev), torch.randn(4, 3, generator=g).to(dev)
            nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(memfit.clip_grad_norm_(model, 0.05, norm_type=clip))
        opt.step()
        opt.zero_grad()
    return opt, norms


def case_cpu_offload_logic(rank, world):
    # On the CPU the compute device is the CPU too: this checks the offload paths (host shards,
    # gradients returned to the host, optimizer on the host) give the same training, bitwise;
    # the memory saving needs an accelerator (MEMFIT_TEST_DEVICE=cuda runs it there).
    results = []
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = memfit.FullyShardedDataParallel(MLP(), auto_wrap_policy=nn.Sequential, offload=offload)
        opt, _ = train(model, rank)
        home = "cpu" if offload else test_device().type
        assert all(p.device.type == home for p in model.parameters())
        assert all(v.device.type == home for s in opt.state.values() for v in s.values() if v.dim())
        assert all(b.device.type == test_device().type for b in model.buffers())
        results.append(values(model))
    same_training(results[0], results[1])
    with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
        memfit.shard(MLP(), offload="disk")


def case_offload_with_clipping_and_accumulation(rank, world):
    # Points 1, 3, 8 of the devices issue with values: a model built on the host, shards
    # offloaded or not, gradients accumulated over two backwards (the host adds what the
    # device copied back) and clipped by the 2-norm and the inf-norm: the same training.
    for clip in (2.0, float("inf")):
        results = []
        for offload in (None, "cpu"):
            torch.manual_seed(0)
            model = memfit.FullyShardedDataParallel(MLP(), auto_wrap_policy=nn.Sequential, offload=offload)
            _, norms = train(model, rank, steps=2, clip=clip, micro=2)
            results.append((values(model), [float(n) for n in norms]))
        same_training(results[0], results[1])
        assert all(n > 0.05 for n in results[0][1])  # clipping took effect


def case_streamed_load_into_offloaded_shards(rank, world):
    # Point 2 with values: rank 0's tensors broadcast on the compute device land in host shards.
    torch.manual_seed(5)
    plain = MLP()
    model = memfit.FullyShardedDataParallel(on_meta_mlp(), auto_wrap_policy=nn.Sequential, offload="cpu")
    memfit.load_full_state_dict(model, plain.state_dict() if rank == 0 else None)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with memfit.summon_full_params(model, writeback=False):
        for n, p in model.named_parameters():
            assert torch.equal(p.cpu(), dict(plain.named_parameters())[n]), n


def case_checkpoint_puts_state_where_torch_does(rank, world):
    # Point 6: a loaded `step` goes where torch's load_state_dict puts it (the device for
    # fused/capturable optimizers), tensors of `extra` back where they were saved from.
    box = [tempfile.mkdtemp(prefix="memfit-device-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    dev = test_device()
    for fused in (False, True):
        torch.manual_seed(0)
        model = memfit.FullyShardedDataParallel(MLP(), auto_wrap_policy=nn.Sequential)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        nn.functional.mse_loss(model(torch.randn(4, 6).to(dev)), torch.zeros(4, 3).to(dev)).backward()
        opt.step()
        rng, on_dev = torch.get_rng_state(), torch.arange(3.0).to(dev)
        memfit.save_checkpoint(path, model, opt, extra={"rng": rng, "on_dev": on_dev})
        opt.state.clear()
        extra = memfit.load_checkpoint(path, model, opt)
        assert extra["rng"].device.type == "cpu" and torch.equal(extra["rng"], rng)
        assert extra["on_dev"].device.type == dev.type and torch.equal(extra["on_dev"], on_dev)
        for s in opt.state.values():
            assert s["step"].device.type == (dev.type if fused else "cpu"), fused
            assert s["exp_avg"].device.type == dev.type
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def case_a_parameter_of_no_rows_is_synced_and_sharded(rank, world):
    # MobileBERT has a (0, 32) parameter: rank 0's rows broadcast, none of them (it crashed there)
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4))
        model.register_parameter("empty", nn.Parameter(torch.zeros(0, 4)))
        return model

    want = [p.detach().clone() for p in build(0).parameters()]  # rank 0's values
    sharded = memfit.FullyShardedDataParallel(build(rank), sync_module_states=True)  # each rank's own
    with memfit.summon_full_params(sharded, writeback=False):
        got = [p.detach().clone() for p in sharded.parameters()]  # the full storage is freed after
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    # and its gradient (of no rows) reduces with the others (_chunk_cat refused an empty one)
    (sharded(torch.ones(2, 4, device=test_device())).sum() + sharded.empty.sum()).backward()
    assert all(p.grad is not None for p in sharded.parameters())


CASES = [
    case_a_parameter_of_no_rows_is_synced_and_sharded,
    case_materialize_peak_and_values,
    case_forward_before_materialize_is_refused,
    case_streamed_load_from_rank_0,
    case_cpu_offload_logic,
    case_offload_with_clipping_and_accumulation,
    case_streamed_load_into_offloaded_shards,
    case_checkpoint_puts_state_where_torch_does,
]
GROUP = Subtests(CASES, on_test_device=True)  # MEMFIT_TEST_DEVICE=cuda: NCCL on CUDA


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deferred_init(world, case):
    GROUP.check(case, world)
