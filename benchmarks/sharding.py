"""Data parallel on 2 gloo ranks (CPU): DDP vs torch FSDP2 vs memfit sharding, HF BERT-MLM.

One run (memfit.testing.run_distributed, the loop behind `memfit bench --world-size N`): each rank builds
the three models from the same random init (fp32, AdamW), each on its own batch of standard
library tokens. Step time: rank 0's median of interleaved repeats after warm-up, each step
between barriers (so it includes waiting for the slower rank). Memory: the per-rank peak of
one step with memfit.MemoryMeter (live tensor bytes; DTensor shards counted by their local
tensors), max over ranks.

    .venv/bin/python benchmarks/sharding.py [--layers 6 --hidden 768 --seq 128 --batch 4]
        [--out benchmarks/results/sharding_cpu.md]
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import MIB, add_shape_args, command, emit, run_distributed, shape_from

from memfit.models import Preset

STRATEGIES = ("DDP", "torch FSDP2", "memfit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, batch=4)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    shape = shape_from(args)
    results = {
        r.name: r
        for r in run_distributed(Preset("bert", shape), args.world_size, STRATEGIES, args.warmup, args.repeats)
    }
    med = {s: results[s].time for s in STRATEGIES}
    peak = {s: results[s].peak for s in STRATEGIES}
    lines = [
        f"# Data parallel on {args.world_size} gloo ranks (CPU): HF BERT-MLM",
        "",
        command("sharding.py"),
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
        b = results[s].breakdown  # rank 0's
        state = b["parameters"] + b["gradients"] + b["optimizer_state"]
        lines.append(
            f"| {s} | {peak[s] / MIB:.1f} | {state / MIB:.1f} | {peak[s] / peak['DDP']:.3f}x | {med[s]:.3f} "
            f"| {med[s] / med['DDP']:.3f}x | {results[s].first_loss:.6f} |"
        )
    lines += [
        "",
        f"- memfit vs FSDP2: peak {peak['memfit'] / peak['torch FSDP2']:.3f}x (target <= 1), "
        f"step time {med['memfit'] / med['torch FSDP2']:.3f}x (target <= 0.85); memfit vs DDP: step time "
        f"{med['memfit'] / med['DDP']:.3f}x (target <= 1.10)",
        "",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
