"""Data parallel on 2 gloo ranks (CPU): DDP vs torch FSDP2 vs memfit sharding, HF BERT-MLM.

One run: each rank builds the three models from the same random init (fp32, AdamW), each
on its own data. Step time: rank 0's median of interleaved repeats after warm-up, each step
between barriers (so it includes waiting for the slower rank). Memory: the per-rank peak of
one step with memfit.MemoryMeter (live tensor bytes; DTensor shards counted by their local
tensors), max over ranks.

    .venv/bin/python benchmarks/sharding.py [--layers 6 --hidden 768 --seq 128 --batch 4]
        [--out benchmarks/results/sharding_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.cli._measure import add_shape_args, emit, shape_from
from memfit.models import bert_layer_class, bert_mlm, mlm_batch

STRATEGIES = ("DDP", "torch FSDP2", "memfit")
MIB = 2**20


def wrap(strategy: str, model: torch.nn.Module) -> torch.nn.Module:
    layer = bert_layer_class()
    if strategy == "DDP":
        return DDP(model)
    if strategy == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, layer):
                fully_shard(m)
        return fully_shard(model)
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer})


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shape = shape_from(args)
    base = bert_mlm(shape, seed=0)
    base.train()
    batch = mlm_batch(shape, seed=rank)
    models = {s: wrap(s, copy.deepcopy(base)) for s in STRATEGIES}
    del base
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-4) for s, m in models.items()}

    def step(s: str, seed: int) -> float:
        torch.manual_seed(seed)
        loss = models[s](**batch).loss
        loss.backward()
        opts[s].step()
        opts[s].zero_grad(set_to_none=True)
        return loss.item()

    losses = {s: step(s, 0) for s in STRATEGIES}
    for i in range(1, args.warmup):
        for s in STRATEGIES:
            step(s, i)
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for r in range(args.repeats):
        for s in STRATEGIES:
            dist.barrier()
            t0 = time.perf_counter()
            step(s, 100 + r)
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
        if rank == 0:
            print(f"round {r + 1}/{args.repeats}", file=sys.stderr)
    peaks = {}
    for s in STRATEGIES:
        with memfit.MemoryMeter(model=models[s], optimizer=opts[s]) as meter:
            step(s, 1000)
        peaks[s] = (meter.peak_bytes, meter.breakdown())
    gathered = [None] * world
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        queue.put({"times": times, "peaks": gathered, "losses": losses})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, batch=4)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world_size, port, args, queue), nprocs=args.world_size, start_method="spawn")
    res = queue.get()
    med = {s: statistics.median(res["times"][s]) for s in STRATEGIES}
    peak = {s: max(r[s][0] for r in res["peaks"]) for s in STRATEGIES}
    shape = shape_from(args)
    lines = [
        f"# Data parallel on {args.world_size} gloo ranks (CPU): HF BERT-MLM",
        "",
        "Command: `" + " ".join([".venv/bin/python benchmarks/sharding.py", *sys.argv[1:]]) + "`",
        "",
        f"Model: BertForMaskedLM, random init, {shape}, per rank; fp32, AdamW. torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores shared by the ranks. Step time: rank 0's median of {args.repeats} "
        f"interleaved repeats after {args.warmup} warm-up steps, between barriers. Peak: MemoryMeter, max over ranks.",
        "",
        "| strategy | per-rank peak MiB | params+grads+AdamW at peak MiB | peak vs DDP | step s (median) | time vs DDP "
        "| first loss (rank 0) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in STRATEGIES:
        b = res["peaks"][0][s][1]
        state = b["parameters"] + b["gradients"] + b["optimizer_state"]
        lines.append(
            f"| {s} | {peak[s] / MIB:.1f} | {state / MIB:.1f} | {peak[s] / peak['DDP']:.3f}x | {med[s]:.3f} "
            f"| {med[s] / med['DDP']:.3f}x | {res['losses'][s]:.6f} |"
        )
    lines += [
        "",
        f"- memfit vs FSDP2: peak {peak['memfit'] / peak['torch FSDP2']:.3f}x (target <= 1), "
        f"step time {med['memfit'] / med['torch FSDP2']:.3f}x (target <= 1); memfit vs DDP: step time "
        f"{med['memfit'] / med['DDP']:.3f}x (target <= 1.2)",
        "",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
