"""Host overhead of a sharded bf16 mixed-precision step at world size 1 (one gloo rank, CPU).

The GPU benchmark (benchmarks/gpu/sharding.py) found memfit's bf16 step on BERT-large at W=1
CPU-bound: the device was busy a third of the step, the rest was host time per unit. Here the
same construction (plain under bf16 autocast; torch FSDP2 ``fully_shard`` per layer then the
root with ``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``; memfit
``FullyShardedDataParallel(auto_wrap_policy=layer, mixed_precision=MixedPrecision(bf16,
reduce_dtype=fp32))``) runs on a tiny BERT (hidden 32, seq 16, batch 2, 24 layers by
default) so that compute is negligible and the step time is the host's own time.

One process, a process group of one gloo rank. The three models step interleaved (warm-up,
then ``--repeats`` rounds, each round one AdamW step of each); the table gives each one's
median, the ratio to plain and to FSDP2, and the host time per unit above plain and above
FSDP2 ((step - other step) / units; units = layers + the root). Counted in one steady-state
forward+backward with memfit.testing's counters: host syncs (``item`` / ``tolist`` / ``__bool__`` /
``_local_scalar_dense`` and blocking uploads; on an accelerator each stops the host) and the
aten ops beyond plain per unit.

    .venv/bin/python benchmarks/sharding_host_overhead.py [--layers 24 --repeats 60]
        [--arch bert|llama] [--out benchmarks/results/sharding_host_overhead_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _common import emit

import memfit
from memfit.models import Preset, Shape, lm_batch, mlm_batch
from memfit.testing import HostSyncCounter, OpCounter

STRATEGIES = ("plain", "torch FSDP2", "memfit")


def wrap(strategy: str, model: torch.nn.Module, layer: type) -> torch.nn.Module:
    """As benchmarks/gpu/sharding.py's ``wrap`` with bf16."""
    if strategy == "plain":
        return model
    if strategy == "memfit":
        mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
        return memfit.FullyShardedDataParallel(model, auto_wrap_policy=layer, mixed_precision=mp)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    for m in [m for m in model.modules() if isinstance(m, layer)]:
        fully_shard(m, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def stepper(strategy: str, model: torch.nn.Module, batch: dict):
    """(the training step, its forward+backward alone)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # as on CUDA
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=strategy == "plain")

    def fwd_bwd() -> None:
        with autocast:
            loss = model(**batch).loss
        loss.backward()

    def step() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, fwd_bwd, opt


def counted(fwd_bwd, opt) -> dict:
    """Host syncs and aten ops of one forward+backward (AdamW's per-parameter .item() on its
    host step counters is the optimizer's, the same for all three, and no device sync)."""
    with HostSyncCounter() as syncs, OpCounter() as ops:
        fwd_bwd()
    opt.zero_grad(set_to_none=True)
    return {"syncs": syncs.count, "syncs_in_backward": len(syncs.in_backward), "ops": ops.total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("bert", "llama"), default="bert")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            lines = measure(args)
        finally:
            dist.destroy_process_group()
    emit(lines, args.out)


def measure(args: argparse.Namespace) -> list[str]:
    shape = Shape(layers=args.layers, hidden=32, heads=2, seq=16, batch=2, vocab=128, dropout=0.0)
    preset = Preset(args.arch, shape)
    base = preset.build()
    batch = (mlm_batch if args.arch == "bert" else lm_batch)(shape)
    layer = preset.layer_class()
    made = {s: stepper(s, wrap(s, copy.deepcopy(base), layer), batch) for s in STRATEGIES}
    steps = {s: m[0] for s, m in made.items()}
    for _ in range(args.warmup):
        for s in STRATEGIES:
            steps[s]()
    counts = {s: counted(*made[s][1:]) for s in STRATEGIES}
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for _ in range(args.repeats):
        for s in STRATEGIES:
            t0 = time.perf_counter()
            steps[s]()
            times[s].append(time.perf_counter() - t0)
    med = {s: statistics.median(v) for s, v in times.items()}
    units = args.layers + 1
    plain, fsdp = med["plain"], med["torch FSDP2"]
    lines = [
        f"# Sharding host overhead, bf16 mixed precision, W=1 (gloo, CPU): {args.arch}, {args.layers} layers",
        "",
        "Command: `" + " ".join([".venv/bin/python benchmarks/sharding_host_overhead.py", *sys.argv[1:]]) + "`",
        "",
        f"Model: {args.arch} hidden 32, 2 heads, seq 16, batch 2, vocab 128, {args.layers} layers, no dropout; "
        f"AdamW (foreach). torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPU cores. "
        f"Median of {args.repeats} interleaved steps after {args.warmup} warm-up; {units} units (layers + root). "
        "Counts: one steady-state forward+backward.",
        "",
        "| strategy | step ms (median) | vs plain | vs FSDP2 | host us / unit vs plain | host us / unit vs FSDP2 "
        "| host syncs / step | of them in backward | aten ops beyond plain / unit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in STRATEGIES:
        t, c = med[s], counts[s]
        extra_ops = (c["ops"] - counts["plain"]["ops"]) / units
        lines.append(
            f"| {s} | {t * 1e3:.2f} | {t / plain:.3f}x | {t / fsdp:.3f}x | {(t - plain) / units * 1e6:.0f} "
            f"| {(t - fsdp) / units * 1e6:.0f} | {c['syncs']} | {c['syncs_in_backward']} | {extra_ops:.1f} |"
        )
    lines += [
        "",
        f"- goal: memfit <= 1.03x plain and <= 1.00x FSDP2: {med['memfit'] / plain:.3f}x, {med['memfit'] / fsdp:.3f}x",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
