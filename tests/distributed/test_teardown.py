"""A spawned rank ends its process groups before the interpreter's teardown and exits normally.

See [Note: Ending a process group] (memfit/cli/_launch.py): gloo's worker threads must end
while the interpreter is alive, which takes freeing every ProcessGroup object; anything that
holds one (a module-level cache, a sharded model that the garbage collector cannot free) keeps
them running into the teardown, where a rank aborted about 1 run in 4 under load.
"""

import atexit
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.testing import end_process_group, spawn


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def _train(model: nn.Module) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 8))


def _models() -> None:
    """Sharded (plain and hybrid: groups made by memfit), DDP and checkpointed models, trained
    and dropped; nothing is kept."""
    _train(memfit.FullyShardedDataParallel(_blocks(), auto_wrap_policy={nn.Sequential}))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _blocks()
    memfit.shard(model[1], mesh=mesh)
    _train(memfit.shard(model, mesh=mesh))
    pp = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "replicate", "shard"))
    _train(memfit.shard(_blocks(), mesh=pp["replicate", "shard"]))  # memfit makes its all-ranks group
    _train(DDP(memfit.checkpoint_module(_blocks())))


def _last_loss() -> torch.Tensor:
    """A sharded model trained and dropped, its last loss kept (as a training loop's ``loss``
    variable is at the end of a script): the finished graph must not hold the model."""
    model = memfit.FullyShardedDataParallel(_blocks(), auto_wrap_policy={nn.Sequential})
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    return loss


def ends_its_groups(rank: int, world: int, out: str) -> int:
    atexit.register(_write, os.path.join(out, f"atexit{rank}.json"), True)
    _models()
    loss = _last_loss()
    # memfit.testing.spawn ends the groups itself after this returns; here the test can see it
    _write(os.path.join(out, f"left{rank}.json"), end_process_group())
    del loss
    return rank


def test_spawned_ranks_free_their_process_groups_and_exit_normally(tmp_path):
    assert spawn(ends_its_groups, 2, str(tmp_path)) == 0
    for rank in range(2):
        # every group freed by destroy_process_group: gloo's threads joined while the interpreter
        # lives (a sharded model that had run a forward kept the default group until the end)
        assert json.loads((tmp_path / f"left{rank}.json").read_text()) == [], f"rank {rank}"
        # the rank left through the interpreter's exit: its exit handlers ran (os._exit skipped them)
        assert (tmp_path / f"atexit{rank}.json").exists(), f"rank {rank}"


def test_end_process_group_without_a_group_is_a_no_op():
    assert not dist.is_initialized() and end_process_group() == []
