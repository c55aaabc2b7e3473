"""Cases of memfit.host_optimizer ([Note: The host step]), ``case(rank, world, root)``: run at
two ranks by tests/distributed/test_host_step.py (one spawned group) and at one rank in this
process by tests/unit/test_host_step.py. Each compares a model sharded with offload="cpu"
whose host step runs in backward against the same model stepped after backward by the
optimizer built with fused=True (the same arithmetic): losses and parameters bitwise."""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit.testing import sharded_units
from tests._models import make_model

ROWS = 8  # the global batch: divisible by 1 and 2 ranks
LR = 1e-2


def batch(i, rank, world):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
    per = ROWS // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def build():
    return memfit.FullyShardedDataParallel(make_model("mlp"), auto_wrap_policy=nn.Sequential, offload="cpu")


def train(model, opt, steps, rank, world, *, micro=1, no_sync=False, clip=None, first=0, between=None):
    """``steps`` optimizer steps of ``micro`` backwards each, ``between()`` after each step's
    backwards (and clip); the losses (this rank's)."""
    losses = []
    for step in range(first, first + steps):
        for m in range(micro):
            x, y = batch(step * micro + m, rank, world)
            ctx = model.no_sync() if no_sync and m < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / micro
                loss.backward()
            losses.append(loss.detach())
        if clip is not None:
            memfit.clip_grad_norm_(model, clip)
        if between is not None:
            between()
        opt.step()
        opt.zero_grad()
    return losses


def host(model, make=torch.optim.AdamW, **kw):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = memfit.host_optimizer(model, make(model.parameters(), lr=LR), **kw)
    return opt, [str(w.message) for w in said if "memfit.host_optimizer" in str(w.message)]


def assert_bitwise(a_model, b_model, a_losses, b_losses):
    assert all(torch.equal(a, b) for a, b in zip(a_losses, b_losses)), (a_losses, b_losses)
    for (n, a), b in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(a, b), n


def host_units(model):
    return sum(any(sp.sharded.requires_grad for sp in u.params) for u in sharded_units(model))


def case_adamw_steps_in_backward_bitwise(rank, world, root):
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, said = host(model)
    assert said == ["memfit.host_optimizer: the host step runs AdamW with fused=True (torch's fused CPU kernels)"]
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert_bitwise(ref, model, train(ref, ref_opt, 3, rank, world), train(model, opt, 3, rank, world))
    assert opt._memfit_host_step.steps_in_backward == 3 * host_units(model) > 0  # every unit, every step
    assert opt._memfit_host_step._worker is not None  # on memfit's worker thread


def case_accumulation_without_no_sync_steps_in_the_last_backward(rank, world, root):
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model, accumulate=3)
    a = train(ref, ref_opt, 2, rank, world, micro=3)
    assert_bitwise(ref, model, a, train(model, opt, 2, rank, world, micro=3))
    assert opt._memfit_host_step.steps_in_backward == 2 * host_units(model)


def case_accumulation_with_no_sync(rank, world, root):
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model)  # the no_sync backwards reduce nothing: the synced one steps
    a = train(ref, ref_opt, 2, rank, world, micro=2, no_sync=True)
    assert_bitwise(ref, model, a, train(model, opt, 2, rank, world, micro=2, no_sync=True))
    assert opt._memfit_host_step.steps_in_backward == 2 * host_units(model)


def case_clipping_steps_after_the_norm(rank, world, root):
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model, max_norm=0.05)
    for step in range(3):
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(ref(x), y).backward()
        norm = memfit.clip_grad_norm_(ref, 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        train(model, opt, 1, rank, world, first=step)
        assert opt._memfit_host_step.last_norm == norm > 0.05  # clipped, by the same norm
    assert opt._memfit_host_step.steps_in_backward == 0  # the norm needs every unit: after backward
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def case_sgd_fused_and_rmsprop_as_given(rank, world, root):
    sgd = lambda ps, lr, **kw: torch.optim.SGD(ps, lr=lr, momentum=0.9, **kw)  # noqa: E731
    for make, how in ((sgd, "SGD with fused=True"), (torch.optim.RMSprop, "RMSprop as given")):
        ref, model = build(), build()
        ref_opt = make(ref.parameters(), lr=LR, **({"fused": True} if make is sgd else {}))
        opt, said = host(model, make)
        assert len(said) == 1 and how in said[0], said
        assert_bitwise(ref, model, train(ref, ref_opt, 2, rank, world), train(model, opt, 2, rank, world))
        assert opt._memfit_host_step.steps_in_backward == 2 * host_units(model)


def case_checkpoint_and_resume(rank, world, root):
    path = os.path.join(root, f"host-step-{world}")
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model)
    a, b = train(ref, ref_opt, 2, rank, world), train(model, opt, 2, rank, world)
    memfit.save_checkpoint(path, model, opt)
    a += train(ref, ref_opt, 2, rank, world, first=2)
    dist.barrier()
    resumed = build()
    opt2, _ = host(resumed)
    memfit.load_checkpoint(path, resumed, opt2)
    b += train(resumed, opt2, 2, rank, world, first=2)
    assert_bitwise(ref, resumed, a, b)


def case_lr_schedulers_made_before_and_after(rank, world, root):
    lam = lambda step: 0.5**step  # noqa: E731
    ref, model, model2 = build(), build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    sched = [torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)]
    opt, _ = host(model)
    sched.append(torch.optim.lr_scheduler.LambdaLR(opt, lam))  # after: it wraps host_optimizer's step
    opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
    sched.append(torch.optim.lr_scheduler.LambdaLR(opt2, lam))  # before: host_optimizer wraps its step
    opt2, _ = host(model2, lambda ps, lr: opt2)
    losses = [[], [], []]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Seems like `optimizer.step()` has been overridden")
        for step in range(3):
            for i, (m, o) in enumerate(((ref, ref_opt), (model, opt), (model2, opt2))):
                losses[i] += train(m, o, 1, rank, world, first=step)
                sched[i].step()
    assert_bitwise(ref, model, losses[0], losses[1])
    assert_bitwise(ref, model2, losses[0], losses[2])
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"] == LR * 0.5**3


def case_misuse_is_refused(rank, world, root):
    model = build()
    opt, _ = host(model)
    x, y = batch(0, rank, world)
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"too late; pass max_norm= to memfit\.host_optimizer"):
        memfit.clip_grad_norm_(model, 1.0)
    with pytest.raises(RuntimeError, match=r"reduced again after its optimizer step ran in backward \(accumulate=1"):
        nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="has a host step already"):
        memfit.host_optimizer(model, opt)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1"):
        memfit.host_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), accumulate=0)


def on_disk(model, opt):
    """Every host shard this optimizer steps, and its AdamW moments, are in the tier's files."""
    tier = opt._memfit_host_step.disk
    assert tier is not None and tier.units
    for u in tier.units:
        for p in opt._memfit_host_step.params[u]:
            assert tier.param_files[u].holds(p)
            state = opt.state[p]
            assert all(tier.state_files[u].holds(state[k]) for k in ("exp_avg", "exp_avg_sq")), u.name
    return True


def disk_dir(root, rank, name):
    path = os.path.join(root, f"disk-{name}-rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path


def case_disk_tier_bitwise_with_accumulation_and_nothing_left_on_disk(rank, world, root):
    for micro, no_sync in ((1, False), (2, False), (2, True)):
        ref, model = build(), build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
        path = disk_dir(root, rank, f"acc{micro}{no_sync}")
        opt, _ = host(model, disk=path, accumulate=1 if no_sync else micro)
        a = train(ref, ref_opt, 2, rank, world, micro=micro, no_sync=no_sync)
        assert_bitwise(ref, model, a, train(model, opt, 2, rank, world, micro=micro, no_sync=no_sync))
        assert on_disk(model, opt) and os.listdir(path) == []  # scratch: unlinked once mapped
        assert opt._memfit_host_step.steps_in_backward == 2 * host_units(model)


def case_disk_tier_clipping(rank, world, root):
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model, max_norm=0.05, disk=disk_dir(root, rank, "clip"))
    a = train(ref, ref_opt, 3, rank, world, clip=0.05)
    assert_bitwise(ref, model, a, train(model, opt, 3, rank, world))
    assert on_disk(model, opt)


def case_disk_tier_checkpoint_and_resume(rank, world, root):
    path = os.path.join(root, f"disk-ckpt-{world}")
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model, disk=disk_dir(root, rank, "ckpt"))
    a, b = train(ref, ref_opt, 2, rank, world), train(model, opt, 2, rank, world)
    memfit.save_checkpoint(path, model, opt)
    a += train(ref, ref_opt, 2, rank, world, first=2)
    dist.barrier()
    resumed = build()
    opt2, _ = host(resumed, disk=disk_dir(root, rank, "resumed"))
    memfit.load_checkpoint(path, resumed, opt2)
    b += train(resumed, opt2, 2, rank, world, first=2)
    assert_bitwise(ref, resumed, a, b)
    assert on_disk(resumed, opt2)


def case_disk_tier_chosen_units_and_a_full_disk(rank, world, root):
    from unittest import mock

    model = build()
    blocks = list(model.blocks)
    opt, _ = host(model, disk=disk_dir(root, rank, "some"), disk_modules=blocks[:2])
    tier = opt._memfit_host_step.disk
    assert [u.module for u in tier.units] == blocks[:2]
    need = tier.bytes
    usage = mock.Mock(free=need - 1)
    path = disk_dir(root, rank, "full")
    with mock.patch("memfit._tiers._disk.shutil.disk_usage", return_value=usage):
        with pytest.raises(ValueError, match=rf"{re.escape(path)} has {need - 1} bytes free .* needs {need} bytes"):
            m2 = build()
            host(m2, disk=path, disk_modules=list(m2.blocks)[:2])
    assert os.listdir(path) == []  # refused before anything was written
    with pytest.raises(ValueError, match="disk_modules must be sharded modules"):
        host(build(), disk=path, disk_modules=[nn.Linear(1, 1)])


def case_gradients_changed_after_their_step_are_refused(rank, world, root):
    """torch's clip_grad_norm_ after units stepped in backward: the steps read unclipped
    gradients, so optimizer.step() refuses instead of going on silently."""
    model = build()
    opt, _ = host(model)
    x, y = batch(0, rank, world)
    nn.functional.mse_loss(model(x), y).backward()
    assert opt._memfit_host_step.steps_in_backward > 0
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"changed after those units stepped in backward .* pass max_norm="):
        opt.step()
    opt.zero_grad()
    stepped = opt._memfit_host_step.steps_in_backward
    train(model, opt, 1, rank, world)  # the next step starts afresh: every unit steps again, in backward
    assert opt._memfit_host_step.steps_in_backward == stepped + host_units(model)


class WithSpare(nn.Module):
    """A block of the MLP as a unit that also holds a Linear no rank uses (its one-element bias
    and weight: an empty shard at two ranks)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.spare = block, nn.Linear(1, 1)

    def forward(self, x):
        return self.block(x)


def build_with_spare():
    model = make_model("mlp")
    model.blocks = nn.ModuleList(WithSpare(b) for b in model.blocks)
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy=WithSpare, offload="cpu")


def case_a_parameter_no_rank_used_bitwise(rank, world, root):
    """Issue 50: a unit with a parameter no rank used (an idle nn.Linear) under the host step,
    as given, with accumulation and under a GradScaler's grad_scale: bitwise against the plain
    run; the idle parameters keep no gradient and no optimizer state, as in one process."""
    for kw in ({}, {"accumulate": 2}, {"scale": True}):
        ref, model = build_with_spare(), build_with_spare()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
        opt, _ = host(model, **{k: v for k, v in kw.items() if k != "scale"})
        if kw.get("scale"):
            for o in (ref_opt, opt):
                o.grad_scale = torch.tensor(1.0)
        micro = kw.get("accumulate", 1)
        a, b = train(ref, ref_opt, 3, rank, world, micro=micro), train(model, opt, 3, rank, world, micro=micro)
        assert_bitwise(ref, model, a, b)
        x, y = batch(9, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        spare = [p for m in model.blocks for p in m.spare.parameters()]
        opt.step()
        assert all(p.grad is None and p not in opt.state for p in spare), kw
        opt.zero_grad()


def case_optimizer_state_loaded_before_host_optimizer(rank, world, root):
    """A state dict loaded into a plain optimizer, then host_optimizer: the DTensor states are
    cut into this rank's rows, the 0-dim parameter's scalar ``step`` is left whole (it was cut
    too: an empty tensor on rank 1, and the step failed there). Bitwise against no reload."""
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    opt, _ = host(model)
    a, b = train(ref, ref_opt, 1, rank, world), train(model, opt, 1, rank, world)
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(model.parameters(), lr=LR)
    fresh.load_state_dict(saved)  # no memfit hooks on it yet: DTensors and scalars as saved
    again, _ = host(model, lambda ps, lr: fresh)
    assert all(st["step"].dim() == 0 for st in again.state.values())
    a += train(ref, ref_opt, 2, rank, world, first=1)
    b += train(model, again, 2, rank, world, first=1)
    assert_bitwise(ref, model, a, b)


CASES = [
    case_adamw_steps_in_backward_bitwise,
    case_gradients_changed_after_their_step_are_refused,
    case_accumulation_without_no_sync_steps_in_the_last_backward,
    case_accumulation_with_no_sync,
    case_clipping_steps_after_the_norm,
    case_sgd_fused_and_rmsprop_as_given,
    case_checkpoint_and_resume,
    case_lr_schedulers_made_before_and_after,
    case_misuse_is_refused,
    case_a_parameter_no_rank_used_bitwise,
    case_optimizer_state_loaded_before_host_optimizer,
    case_disk_tier_bitwise_with_accumulation_and_nothing_left_on_disk,
    case_disk_tier_clipping,
    case_disk_tier_checkpoint_and_resume,
    case_disk_tier_chosen_units_and_a_full_disk,
]
