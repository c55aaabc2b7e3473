"""Data parallel strategies on N spawned ranks: DDP, memfit sharding, torch FSDP2.

Rank r computes where ``--device`` says (memfit.cli._launch.choose_device): on GPU r with
NCCL, or on the CPU with gloo.

Each rank resolves the model spec (memfit.models._spec.resolve) and builds every strategy's
model from the same random init (per-rank batches) and runs the measurement loop of `memfit bench`
across ranks (memfit.cli._measure.run): step time is rank 0's median of interleaved repeats
after warm-up, each step between barriers (so it includes waiting for the slowest rank);
memory is each rank's peak of one step with MemoryMeter (DTensor shards by their local
tensors), the maximum over ranks.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.cli._data import batch_at
from memfit.cli._launch import choose_device, spawn
from memfit.cli._measure import Result, run
from memfit.models import Preset
from memfit.models._spec import ModelSpec, layer_class, resolve

STRATEGIES = ("DDP", "memfit", "torch FSDP2")


def _wrap(strategy: str, model: torch.nn.Module, layer: type, device: torch.device) -> torch.nn.Module:
    if strategy == "DDP":
        return DDP(model, device_ids=[device] if device.type == "cuda" else None)
    if strategy == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, layer):
                fully_shard(m)
        return cast(torch.nn.Module, fully_shard(model))
    return cast(torch.nn.Module, memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer}))


def _model(spec: Preset | dict) -> ModelSpec:
    """A Preset as is (benchmarks pass shapes of their own), else ``resolve(**spec)``."""
    if isinstance(spec, Preset):
        arch = "bert" if spec.arch == "bert" else "causal"
        return ModelSpec(spec.arch, arch, spec.build, spec.shape.seq, spec.shape.batch)
    return resolve(**spec, command="memfit bench")


def _worker(
    rank: int, world: int, spec: Preset | dict, strategies: tuple[str, ...], warmup: int, repeats: int, device: str
):
    dev = choose_device(device, env={"LOCAL_RANK": str(rank)}, spawned=world).device  # as spawn placed this rank
    model = _model(spec)
    base = model.build(0).to(dev)
    base.train()
    batch = {k: v.to(dev) for k, v in batch_at(model.arch, model.batch, model.seq, step=rank).items()}
    models = {s: _wrap(s, copy.deepcopy(base), layer_class(base), dev) for s in strategies}
    del base
    return run(models, batch, warmup, repeats, progress=lambda msg: None, across_ranks=True)


def run_distributed(
    spec: Preset | dict, world: int, strategies: tuple[str, ...], warmup: int, repeats: int, device: str = "cpu"
) -> list[Result]:
    """One result per strategy, as rank 0 saw it (its step times, breakdown and first loss),
    with the peak the maximum over ranks. ``spec``: resolve()'s arguments (name, sizes), or a Preset;
    ``device``: as ``--device``."""
    return spawn(_worker, world, spec, strategies, warmup, repeats, device, device=device, where="memfit bench")
