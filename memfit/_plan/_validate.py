"""A forecast against a measured step: one process, or a rank of a sharded group."""

from __future__ import annotations

import copy
import gc
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from memfit._plan._plan import Plan
from memfit._plan._step import Inputs, _make_optimizer, step_loss
from memfit._shard._api import FullyShardedDataParallel
from memfit._shard._mixed import MixedPrecision
from memfit.memory import MemoryMeter


def measured_sharded_peak(
    plan: Plan,
    model: nn.Module,
    inputs: Inputs,
    layer: type,
    *,
    loss_fn=None,
    steps: int = 2,
    mixed_precision: MixedPrecision | None = None,
    accumulate: int = 1,
) -> int:
    """Train a copy of ``model`` under ``plan``, sharded over the process group (each block of
    class ``layer`` a unit, the root the rest), and return the largest peak over ranks of its
    last step (MemoryMeter; after the first step the optimizer state exists), under
    ``mixed_precision`` when given; ``accumulate`` micro-batches (``inputs`` each) a step."""
    model = plan.apply(copy.deepcopy(model))
    model.train()
    wrap = {"auto_wrap_policy": {layer}, "mixed_precision": mixed_precision}
    model = cast(nn.Module, FullyShardedDataParallel(model, **wrap))
    opt = _make_optimizer("adamw", model)
    for _ in range(steps):
        # Garbage in reference cycles is freed when Python's collector runs, which other threads
        # (a multiprocessing queue's feeder) can move: collect first, and not during the step.
        gc.collect()
        gc.disable()
        try:
            with MemoryMeter(model=model, optimizer=opt) as meter:
                for _ in range(accumulate):
                    step_loss(model, inputs, loss_fn).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            gc.enable()
    peak = torch.tensor([meter.peak_bytes], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)
