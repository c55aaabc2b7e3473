"""Runtime overhead of sharding per unit, memfit vs torch FSDP2, on 2 gloo ranks (CPU).

A model of many tiny units (each a Linear(16, 16) and a LayerNorm(16): compute negligible), so
the step time is the runtime's own host time. Each rank builds the same model three times: plain
(no data parallel), torch FSDP2 (``fully_shard`` per block, then the root) and memfit
(``FullyShardedDataParallel(auto_wrap_policy=Block)``), fp32 or ``--bf16`` mixed precision
(FSDP2: ``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``; memfit: ``MixedPrecision(bf16,
reduce_dtype=fp32)``; both keep fp32 shards, gather bf16 and reduce fp32). Counted the same way
for both, in one steady-state forward+backward (after 2 steps):

- host syncs: ``Tensor.item`` / ``tolist`` / ``__bool__`` and ``aten._local_scalar_dense`` calls
  (each stops the host until the device drains on an accelerator);
- launches per unit: aten ops other than views and allocations that reach the dispatcher
  (a TorchDispatchMode), minus the plain model's, divided by the number of units;
- wire bytes per step: the bytes the collectives the dispatcher sees send from this rank (c10d
  ``_allgather_base_`` / ``_reduce_scatter_base_``: output resp. input x (W-1)/W, as a ring;
  ``allreduce_``: 2 x (W-1)/W; ``alltoall_base_``: what it sends to other ranks). memfit's
  reduce-scatter on 2 gloo ranks is an all-to-all of (W-1)/W of the input; gloo's own
  ``_reduce_scatter_base_``, which FSDP2 calls, is an all-reduce of a clone of its input
  underneath (2 (W-1)/W) but counts as a reduce-scatter here.

Time: rank 0's median over interleaved repeats of one forward+backward+SGD step between
barriers; host time per unit = (sharded step - plain step) / units.

    .venv/bin/python benchmarks/sharding_overhead.py [--units 48 --repeats 20 --bf16]
        [--out benchmarks/results/sharding_overhead_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import emit
from torch import nn

import memfit
from memfit.testing import HostSyncCounter, OpCounter, free_port

STRATEGIES = ("plain", "torch FSDP2", "memfit")


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.norm(self.lin(x))


def tiny(units: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(units)])


def wrap(name: str, model: nn.Module, bf16: bool) -> nn.Module:
    if name == "plain":
        return model
    if name == "memfit":
        mp_ = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        return memfit.FullyShardedDataParallel(model, auto_wrap_policy=Block, mixed_precision=mp_)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for m in model:
        fully_shard(m, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def fwd_bwd(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()


def counts(model: nn.Module, x: torch.Tensor) -> dict:
    """Syncs, launches and wire bytes of one forward+backward (gradients set to None after)."""
    with HostSyncCounter() as syncs, OpCounter() as ops:
        fwd_bwd(model, x)
    for p in model.parameters():
        p.grad = None
    return {"syncs": syncs.count, "launches": ops.launches, "wire": ops.wire_bytes, "ops": dict(ops.kernels)}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    base = tiny(args.units)
    models = {s: wrap(s, copy.deepcopy(base), args.bf16) for s in STRATEGIES}
    opts = {s: torch.optim.SGD(m.parameters(), lr=1e-3) for s, m in models.items()}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        for s in STRATEGIES:
            step(models[s], opts[s], x)
    measured = {s: counts(models[s], x) for s in STRATEGIES}
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for _ in range(args.repeats):
        for s in STRATEGIES:
            dist.barrier()
            t0 = time.perf_counter()
            step(models[s], opts[s], x)
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"counts": measured, "time": {s: statistics.median(v) for s, v in times.items()}})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", type=int, default=48)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bf16", action="store_true", help="mixed precision, bf16 compute (fp32 LayerNorms in memfit)")
    p.add_argument("--out")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.world_size, port, args, q)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    res = q.get(timeout=1200)
    for proc in procs:
        proc.join()
    c, t = res["counts"], res["time"]
    units = args.units + 1  # the blocks and the root (which holds no parameters of its own)
    lines = [
        f"# Sharding runtime overhead: {args.units} tiny blocks, {args.world_size} gloo ranks (CPU)",
        "",
        "Command: `.venv/bin/python benchmarks/sharding_overhead.py " + " ".join(sys.argv[1:]) + "`",
        "",
        f"Model: {args.units} x (Linear(16,16) + LayerNorm(16)), batch 4 per rank, "
        f"{'bf16 mixed precision' if args.bf16 else 'fp32'}, SGD. torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores shared by the ranks. Counts: one steady-state forward+backward on "
        f"rank 0. Time: rank 0's median of {args.repeats} interleaved steps between barriers.",
        "",
        "| strategy | host syncs / step | launches / unit | wire bytes / step | step ms (median) "
        "| host us / unit vs plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in STRATEGIES:
        per_unit = (c[s]["launches"] - c["plain"]["launches"]) / units
        over = (t[s] - t["plain"]) / units * 1e6
        lines.append(f"| {s} | {c[s]['syncs']} | {per_unit:.1f} | {c[s]['wire']:.0f} | {t[s] * 1e3:.2f} | {over:.0f} |")
    ratio = (t["memfit"] - t["plain"]) / max(t["torch FSDP2"] - t["plain"], 1e-12)
    lines += ["", f"- memfit / FSDP2 host time per unit: {ratio:.3f}x (target <= 1)", ""]
    for s in ("torch FSDP2", "memfit"):
        diff = {k: v - c["plain"]["ops"].get(k, 0) for k, v in c[s]["ops"].items()}
        top = sorted(((v, k) for k, v in diff.items() if v), reverse=True)[:12]
        lines.append(f"- {s} ops per step beyond plain: " + ", ".join(f"{k} {v}" for v, k in top))
    emit([*lines, ""], args.out)


if __name__ == "__main__":
    main()
