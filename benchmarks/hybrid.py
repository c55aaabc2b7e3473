"""Hybrid sharding on 4 gloo ranks as 2 "nodes" of 2 (CPU): DDP, full sharding over the 4
ranks, memfit HSDP 2x2 and torch FSDP2's HSDP 2x2, HF BERT-MLM, in one run.

Each rank builds the four models from the same random init (fp32, AdamW), each on its own
batch; the loop of `memfit bench --world-size N` times them (rank 0's median of interleaved
repeats after warm-up, each step between barriers) and measures the per-rank peak
(MemoryMeter, max over ranks). Bytes per link: what rank 0 sends in one step (ring bytes:
(W-1)/W of the buffer for an all-gather or reduce-scatter, 2 (W-1)/W for an all-reduce), by
process group, counted the same way for all four: memfit's own counters, and for torch a
wrapper on torch.distributed's collectives (FSDP2's, and DDP's bucketed all-reduces through
its default communication hook). Ranks 0-1 are node A, 2-3 node B; a group that spans both is inter-node.

    .venv/bin/python benchmarks/hybrid.py [--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --vocab 8192]
        [--out benchmarks/results/hybrid_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from _common import MIB, add_shape_args, batch_at, command, emit, run, shape_from, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
import memfit.testing
from memfit.models import Preset

STRATEGIES = ("DDP", "memfit full sharding (W=4)", "memfit HSDP 2x2", "torch FSDP2 HSDP 2x2")
WORLD, NODE = 4, 2


class TorchCounter:
    """Ring bytes per process group of torch's collectives (FSDP2 calls them through torch.distributed)."""

    def __init__(self) -> None:
        self.by_group: dict[tuple[int, ...], float] = {}
        self.on = False
        for name, factor in (("all_gather_single", 1), ("reduce_scatter_single", 1), ("all_reduce", 2)):
            self._wrap(name, factor)

    def _wrap(self, name: str, factor: int) -> None:
        real = getattr(dist, name)

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            big = max(tensors, key=lambda t: t.numel())  # the full buffer: gathered output, scattered input
            self.add(group, big.numel() * big.element_size(), factor)
            return real(*args, **kwargs)

        setattr(dist, name, counted)

    def add(self, group, nbytes: int, factor: int) -> None:
        if self.on:
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            w = len(ranks)
            self.by_group[ranks] = self.by_group.get(ranks, 0.0) + factor * nbytes * (w - 1) / w


def _ddp(model: torch.nn.Module) -> torch.nn.Module:
    """DDP whose bucket all-reduces go through torch.distributed.all_reduce (its default hook,
    in Python), where the counter sees them."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp


def _wrap(strategy: str, model: torch.nn.Module, layer: type, mesh) -> torch.nn.Module:
    if strategy == "DDP":
        return _ddp(model)
    if strategy.startswith("torch"):
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, layer):
                fully_shard(m, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if "HSDP" in strategy:
        return memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer}, device_mesh=mesh)
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer})


def _bytes_per_group(name: str, model, batch: dict, counter: TorchCounter) -> dict[tuple[int, ...], float]:
    """Rank 0's ring bytes per process group in one training step (after the timed ones)."""
    stats = memfit.testing.collective_stats()
    stats.reset()
    counter.by_group, counter.on = {}, True
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    counter.on = False
    if name.startswith("memfit"):
        return {g: s.bytes for g, s in stats.by_group.items()}
    return dict(counter.by_group)


def _worker(rank: int, world: int, preset: Preset, warmup: int, repeats: int):
    counter = TorchCounter()
    mesh = init_device_mesh("cpu", (WORLD // NODE, NODE), mesh_dim_names=("replicate", "shard"))
    base = preset.build()
    base.train()
    batch = batch_at(preset.arch, preset.shape.batch, preset.shape.seq, step=rank)
    models = {s: _wrap(s, copy.deepcopy(base), preset.layer_class(), mesh) for s in STRATEGIES}
    del base
    results = run(models, batch, warmup, repeats, progress=lambda msg: None, across_ranks=True)
    links = {s: _bytes_per_group(s, m, batch, counter) for s, m in models.items()}
    return results, links


def _split(groups: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """(bytes over groups inside one node, bytes over groups spanning nodes)."""
    inside = sum(b for g, b in groups.items() if len({r // NODE for r in g}) == 1)
    return inside, sum(groups.values()) - inside


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=4, hidden=256, heads=4, batch=4, vocab=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    shape = shape_from(args)
    params = sum(t.numel() for t in Preset("bert", shape).build().parameters())
    results, links = spawn(_worker, WORLD, Preset("bert", shape), args.warmup, args.repeats)
    res = {r.name: r for r in results}
    load = os.getloadavg()
    lines = [
        '# Hybrid sharding on 4 gloo ranks as 2 "nodes" of 2 (CPU): HF BERT-MLM',
        "",
        command("hybrid.py"),
        "",
        f"Model: BertForMaskedLM, random init, {shape}, per rank ({params / 1e6:.2f}M parameters, "
        f"{params * 4 / MIB:.1f} MiB fp32); AdamW. torch {torch.__version__}, {os.cpu_count()} CPU cores shared by "
        f"the 4 ranks; load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min; other "
        f"work shares this machine). Step time: rank 0's median of {args.repeats} interleaved repeats after "
        f"{args.warmup} warm-up steps, between barriers. Peak: MemoryMeter, max over ranks. Bytes: what rank 0 "
        "sends in one step, by process group (ranks 0-1 node A, 2-3 node B).",
        "",
        "| strategy | per-rank peak MiB | step s (median) | time vs DDP | MiB within a node | MiB across nodes "
        "| groups (ranks: MiB) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ddp = res["DDP"].time
    for s in STRATEGIES:
        inside, across = _split(links[s])
        groups = ", ".join(f"{list(g)}: {b / MIB:.2f}" for g, b in sorted(links[s].items()))
        lines.append(
            f"| {s} | {res[s].peak / MIB:.1f} | {res[s].time:.3f} | {res[s].time / ddp:.3f}x | {inside / MIB:.2f} "
            f"| {across / MIB:.2f} | {groups} |"
        )
    m, t = res["memfit HSDP 2x2"], res["torch FSDP2 HSDP 2x2"]
    lines += [
        "",
        f"- memfit HSDP vs torch FSDP2 HSDP: step time {m.time / t.time:.3f}x, per-rank peak {m.peak / t.peak:.3f}x "
        f"(target <= 1 for both); first losses {m.first_loss:.6f} / {t.first_loss:.6f}.",
        "",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
