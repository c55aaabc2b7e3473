"""memfit.autoconfigure's predictions against measured steps on 2 gloo ranks (CPU), tiny GPT-2.

On paper first: autoconfigure prices every configuration (micro-batch x accumulation for the
global batch; replicated, fully sharded, fully sharded without resharding) on a device profile.
Then each configuration that fits runs for real on spawned gloo ranks: replicated as torch DDP
(no_sync for all but the last micro-batch), sharded as memfit.FullyShardedDataParallel (each
block a unit, reshard_after_forward as configured), the plan's checkpoint decisions applied,
AdamW. Step time: rank 0's median of the repeats after warm-up, each step between barriers.
Peak: rank 0's MemoryMeter over the last step (AdamW's state exists). The table compares the
predicted and measured step time and the rank of each configuration by both, and the pick's
measured time with the best measured one.

    .venv/bin/python benchmarks/autoconfig.py [--layers 2 --hidden 64 --seq 64 --global-batch 8
        --budget 64MB --device-profile cpu] [--out benchmarks/results/autoconfig_cpu.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import MIB, command, emit, spawn
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.cli._data import batch_at
from memfit.models import Preset, Shape


def _config(result: memfit.AutoConfig) -> list[tuple]:
    return [
        (c.micro_batch, c.accumulation, c.layout.shard_size, c.layout.reshard_after_forward, _decisions(c.plan))
        for c in result.candidates
        if c.fits and c.plan is not None
    ]


def _decisions(plan: memfit.Plan) -> dict[str, memfit.Decision]:
    return {path: plan.decision(kind) for path, kind in plan.decisions.items()}


def _worker(rank: int, world: int, preset: Preset, configs: list[tuple], warmup: int, repeats: int):
    return [_measure(rank, preset, *config, warmup, repeats) for config in configs]


def _build(preset: Preset, shards: int, reshard: bool, decisions: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = preset.build()
    model.train()
    for path, decision in decisions.items():  # the plan autoconfigure chose for this configuration
        decision.apply(model.get_submodule(path), name=path)
    if shards == 1:
        return DDP(model)
    return memfit.FullyShardedDataParallel(
        model, auto_wrap_policy={preset.layer_class()}, reshard_after_forward=reshard
    )


def _step(model, opt, batches: list[dict], replicated: bool) -> None:
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        with model.no_sync() if replicated and not last else contextlib.nullcontext():  # DDP: all-reduce once
            model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(rank, preset, micro, accumulation, shards, reshard, decisions, warmup, repeats) -> tuple[float, int]:
    """Rank 0's median step time and the peak of its last step."""
    model = _build(preset, shards, reshard, decisions)
    opt = torch.optim.AdamW(model.parameters())
    seq = preset.shape.seq
    batches = [batch_at(preset.arch, micro, seq, step=rank * accumulation + k) for k in range(accumulation)]
    times = []
    for _ in range(warmup + repeats - 1):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, batches, shards == 1)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    with memfit.MemoryMeter(model=model, optimizer=opt) as meter:
        _step(model, opt, batches, shards == 1)
    dist.barrier()
    times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]), meter.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--budget", default="64MB")
    p.add_argument("--device-profile", default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    w = args.world_size
    shape = Shape(layers=args.layers, hidden=args.hidden, heads=4, seq=args.seq, batch=1, vocab=args.vocab, dropout=0.0)
    preset = Preset("gpt2", shape)
    torch.manual_seed(0)
    model = preset.build()
    batch = batch_at(preset.arch, 1, shape.seq, step=0)
    t0 = time.perf_counter()
    result = memfit.autoconfigure(
        model,
        batch,
        budget=args.budget,
        world_size=w,
        global_batch=args.global_batch,
        device_profile=args.device_profile,
        shard_sizes=[1, w],
        chunk_head=False,
    )
    searched = time.perf_counter() - t0
    fits = [c for c in result.candidates if c.fits]
    measured = spawn(_worker, w, preset, _config(result), args.warmup, args.repeats)
    emit(_report(args, shape, result, fits, measured, searched), args.out)


def _report(args, shape, result, fits, measured, searched) -> list[str]:
    by_measured = sorted(range(len(fits)), key=lambda i: measured[i][0])
    rank_measured = {i: r + 1 for r, i in enumerate(by_measured)}
    lines = [
        f"# memfit.autoconfigure: predicted vs measured, {args.world_size} gloo ranks (CPU), tiny GPT-2",
        "",
        command("autoconfig.py"),
        "",
        f"Model: GPT2LMHeadModel, random init, {shape}; fp32, AdamW; global batch {args.global_batch}, budget "
        f"{args.budget} per rank; time priced on the {args.device_profile!r} profile. torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores shared by the ranks and by other work (measured under load: load average "
        f"{os.getloadavg()[0]:.1f} at the end). Step: rank 0's median of {args.repeats} after {args.warmup} "
        f"warm-up, between barriers. The search took {searched:.1f} s wall.",
        "",
        "| micro | accum | layout | predicted ms | measured ms | measured / predicted | rank predicted | rank "
        "measured | predicted peak MiB | measured peak MiB (rank 0) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, c in enumerate(fits):
        t, peak = measured[i]
        lines.append(
            f"| {c.micro_batch} | {c.accumulation} | {c.layout.describe()} | {c.step_time * 1e3:.1f} | {t * 1e3:.1f} "
            f"| {t / c.step_time:.2f} | {i + 1} | {rank_measured[i]} | {c.peak / MIB:.2f} | {peak / MIB:.2f} |"
        )
    best = by_measured[0]
    lines += [
        "",
        f"- pick: micro-batch {result.micro_batch} x {result.accumulation}, {result.layout.describe()}: measured "
        f"{measured[0][0] * 1e3:.1f} ms; best measured: {fits[best].micro_batch} x {fits[best].accumulation}, "
        f"{fits[best].layout.describe()} at {measured[best][0] * 1e3:.1f} ms (pick / best "
        f"{measured[0][0] / measured[best][0]:.2f}x)",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
