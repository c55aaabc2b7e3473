"""Cases of the disk tier of memfit.host_optimizer ([Note: The disk tier], [Note: Gradients on
the disk tier]), ``case(rank, world, root)``: run at two ranks by
tests/distributed/test_disk_tier.py (one spawned group) and at one rank in this process by
tests/unit/test_disk_tier.py. Parity is bitwise against the optimizer built with fused=True
and stepped after backward; descriptors, reserved blocks and resident pages are read from
/proc and fstat (Linux)."""

from __future__ import annotations

import gc
import mmap
import os

import torch
from torch import nn

import memfit
from tests._host_step import LR, assert_bitwise, disk_dir, host, train
from tests._models import tanh_blocks

H = 64  # a block's Linear is H x H: 16 KiB of fp32, a few pages per rank


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, H), *tanh_blocks(4, 1, H), nn.Linear(H, 3))
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy=nn.Sequential, offload="cpu")


def open_fds(under) -> int:
    """This process's descriptors open on files in the folder ``under`` (unlinked files read
    as "PATH (deleted)"): other threads of a long test process open and close their own."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed while listed
            pass
    return sum(1 for target in fds if target.startswith(os.path.realpath(under) + os.sep))


def resident(files) -> int:
    """Bytes of the files' mappings resident in this process (their Rss in /proc/self/smaps)."""
    starts = {f._base for f in files}
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                counting = int(head.split("-")[0], 16) in starts
            elif counting and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def case_descriptors_close_with_the_host_step_and_at_collection(rank, world, root):
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    train(ref, ref_opt, 2, rank, world)
    where, backstop = disk_dir(root, rank, "fds"), disk_dir(root, rank, "fds-gc")
    model = build()
    opt, _ = host(model, disk=where)
    train(model, opt, 2, rank, world)
    tier = opt._memfit_host_step.disk
    files = [*tier.param_files.values(), *tier.state_files.values(), *getattr(tier, "grad_files", {}).values()]
    assert open_fds(where) == len(files) > 0, (open_fds(where), len(files))  # one a file
    opt._memfit_host_step.close()
    assert open_fds(where) == 0 and all(f.closed for f in files)
    assert_bitwise(ref, model, [], [])  # closed: the shards still view the mapping, and read it
    opt._memfit_host_step.close()  # idempotent
    model = build()  # the backstop: the optimizer collected without close()
    opt, _ = host(model, disk=backstop)
    train(model, opt, 1, rank, world)
    assert open_fds(backstop) > 0
    del model, opt, tier, files
    gc.collect()
    assert open_fds(backstop) == 0


def case_files_are_reserved_not_sparse(rank, world, root):
    from unittest import mock

    model = build()
    opt, _ = host(model, disk=disk_dir(root, rank, "blocks"))
    train(model, opt, 1, rank, world)  # (the state files are made at the first step)
    tier = opt._memfit_host_step.disk
    files = [*tier.param_files.values(), *tier.state_files.values(), *getattr(tier, "grad_files", {}).values()]
    assert len(files) == 3 * len(tier.units)
    for f in files:
        assert os.fstat(f._fd).st_blocks * 512 >= f.nbytes, f.what  # every byte has its block on disk
    path = disk_dir(root, rank, "enospc")
    with mock.patch("os.posix_fallocate", side_effect=OSError(28, "No space left on device")):
        try:
            host(build(), disk=path)
        except ValueError as e:
            said = str(e)
        else:
            raise AssertionError("a disk that cannot reserve the files must be refused")
    assert f"{path} cannot reserve" in said and "No space left on device" in said and "bytes" in said, said
    assert os.listdir(path) == []


def case_the_step_after_backward_holds_one_unit_at_a_time(rank, world, root):
    """Clipping and overlap=False step after backward: unit by unit, each unit's files
    released before the next one's step, so what is resident is one unit's, not the model's."""
    for kw in ({"max_norm": 0.05}, {"overlap": False}):
        ref, model = build(), build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
        opt, _ = host(model, disk=disk_dir(root, rank, f"bounded-{len(kw)}-{next(iter(kw))}"), **kw)
        tier = opt._memfit_host_step.disk
        tier.depth = 0  # no read ahead: the bound below is one unit's files
        one = max(sum(pages(f.nbytes) for f in (tier.param_files[u], tier.grad_files[u])) for u in tier.units)
        at_units, at_hook = [], []
        tier.watch = lambda at=at_units, t=tier: at.append(resident(t.files()))
        opt.register_step_post_hook(lambda *_, at=at_hook, t=tier: at.append(resident(t.files())))
        clip = kw.get("max_norm")
        a = train(ref, ref_opt, 3, rank, world, clip=clip)
        assert_bitwise(ref, model, a, train(model, opt, 3, rank, world))
        states = {u: pages(tier.state_files[u].nbytes) for u in tier.units}
        assert len(at_units) == 3 * len(tier.units)  # sampled at each unit's step
        assert max(at_units) <= one + max(states.values()), (at_units, one)
        assert at_hook == [0, 0, 0]  # the user's step (its hooks) after every disk unit was released


def case_gradients_live_on_disk_bitwise(rank, world, root):
    """Gradients of disk units are in the tier's files between backward and the step, with
    accumulation (accumulate=, no_sync), clipping and stepping in backward; bitwise."""
    for micro, no_sync, clip in ((1, False, None), (2, False, None), (2, True, None), (2, False, 0.05)):
        ref, model = build(), build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
        kw = {"max_norm": clip} if clip else {}
        path = disk_dir(root, rank, f"grads{micro}{no_sync}{clip}")
        opt, _ = host(model, disk=path, accumulate=1 if no_sync else micro, **kw)
        tier = opt._memfit_host_step.disk
        seen = []

        def on_disk(tier=tier, opt=opt, seen=seen):
            grads = [(u, p.grad) for u in tier.units for p in opt._memfit_host_step.params[u] if p.grad is not None]
            assert grads and all(tier.grad_files[u].holds(g) for u, g in grads)
            seen.append(len(grads))

        a = train(ref, ref_opt, 2, rank, world, micro=micro, no_sync=no_sync, clip=clip)
        b = train(model, opt, 2, rank, world, micro=micro, no_sync=no_sync, between=on_disk)
        assert_bitwise(ref, model, a, b)
        assert len(seen) == 2
        assert all(f.written > 0 for f in tier.grad_files.values())  # written behind


CASES = [
    case_descriptors_close_with_the_host_step_and_at_collection,
    case_files_are_reserved_not_sparse,
    case_the_step_after_backward_holds_one_unit_at_a_time,
    case_gradients_live_on_disk_bitwise,
]
