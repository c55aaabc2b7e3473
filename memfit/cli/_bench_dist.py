"""Data parallel strategies on N spawned gloo ranks: DDP, memfit sharding, torch FSDP2.

Each rank builds every strategy's model from the same random init (the preset's
architecture and shape, per-rank batches). Step time: rank 0's median of interleaved repeats
after warm-up, each step between barriers (so it includes waiting for the slowest rank).
Memory: each rank's peak of one step with MemoryMeter (DTensor shards by their local
tensors); the maximum over ranks is reported.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.cli._data import batch_at
from memfit.cli._launch import spawn
from memfit.models import Preset, Shape

STRATEGIES = ("DDP", "memfit", "torch FSDP2")


def _wrap(strategy: str, model: torch.nn.Module, layer: type) -> torch.nn.Module:
    if strategy == "DDP":
        return DDP(model)
    if strategy == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, layer):
                fully_shard(m)
        return fully_shard(model)
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer})


def _worker(rank, world, arch, shape, strategies, warmup, repeats) -> dict:
    preset = Preset(arch, Shape(**shape))
    base = preset.build()
    base.train()
    batch = batch_at(arch, preset.shape.batch, preset.shape.seq, step=rank)
    models = {s: _wrap(s, copy.deepcopy(base), preset.layer_class()) for s in strategies}
    del base
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-4) for s, m in models.items()}

    def step(s: str, seed: int) -> float:
        torch.manual_seed(seed)
        loss = models[s](**batch).loss
        loss.backward()
        opts[s].step()
        opts[s].zero_grad(set_to_none=True)
        return loss.item()

    losses = {s: step(s, 0) for s in strategies}
    for i in range(1, warmup):
        for s in strategies:
            step(s, i)
    times: dict[str, list[float]] = {s: [] for s in strategies}
    for r in range(repeats):
        for s in strategies:
            dist.barrier()
            t0 = time.perf_counter()
            step(s, 100 + r)
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
    peaks = {}
    for s in strategies:
        with memfit.MemoryMeter(model=models[s], optimizer=opts[s]) as meter:
            step(s, 1000)
        peaks[s] = (meter.peak_bytes, meter.breakdown())
    gathered = [None] * world
    dist.all_gather_object(gathered, peaks)
    return {"times": times, "peaks": gathered, "losses": losses}


def run_distributed(preset: Preset, world: int, strategies: tuple[str, ...], warmup: int, repeats: int) -> list[dict]:
    """One row per strategy: per-rank peak (max over ranks), its breakdown on rank 0, median
    step time on rank 0, and the first loss on rank 0."""
    res = spawn(_worker, world, preset.arch, asdict(preset.shape), strategies, warmup, repeats)
    return [
        {
            "strategy": s,
            "peak_bytes": max(r[s][0] for r in res["peaks"]),
            "breakdown_rank0": res["peaks"][0][s][1],
            "step_seconds": statistics.median(res["times"][s]),
            "loss": res["losses"][s],
        }
        for s in strategies
    ]
