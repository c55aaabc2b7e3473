"""memfit.autoconfigure's predictions against measured steps on gloo ranks (CPU): BERT, GPT-2
(tied embeddings) and Llama at world sizes 2 and 4.

For each world size one group of ranks is spawned. Its ranks first calibrate this machine
together (memfit's calibrate_group: each rank's compute measured while every rank runs, then
the group's collectives; see [Note: Calibrating the links]); autoconfigure then prices every
configuration of each model on that profile (micro-batch x accumulation for the global batch;
replicated, hybrid and fully sharded, with and without reshard_after_forward) and each
configuration that fits the budget runs for real: replicated on memfit's units over a W x 1
mesh, as `memfit train --hybrid-shards 1` runs it and autoconfigure forecasts it (--replicated
ddp: torch DDP, which holds a copy of the gradients more; no_sync for all but the last
micro-batch either way), sharded as memfit.FullyShardedDataParallel over a
mesh of replicas x shards (each block a unit), the plan's checkpoint decisions applied, AdamW. Step time: the
median of the repeats after warm-up, each step between barriers (the slowest rank's), the
configurations of a model run in rounds (two steps of each per round, the second timed: drift
falls on all alike, and each timed step follows its own).
Peak: the largest over ranks of MemoryMeter over the last step (AdamW's state exists). The
table compares predicted and measured step time and the pick's measured time with the best;
with --trials K (default 4) memfit's AutoConfig.measure then tries the top K for real (its
own warm-up and median), and its pick's time in the grid is compared with the best too, and
every grid point's measured time with its price times the trials' scale (AutoConfig.trial_scale:
the median measured / priced of the K tried; see [Note: Trying configurations]).

    .venv/bin/python benchmarks/autoconfig.py [--models bert,gpt2,llama --worlds 2,4
        --global-batch 16 --budget 40MB --replicated memfit|ddp] [--out benchmarks/results/autoconfig_cpu.md]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import MIB, command, emit, spawn
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit._plan._calibrate import calibrate_group
from memfit.cli._data import batch_at
from memfit.models import Preset, Shape


def _decisions(plan: memfit.Plan) -> dict[str, memfit.Decision]:
    return {path: plan.decision(kind) for path, kind in plan.decisions.items()}  # its rule and offload too


def _build(preset: Preset, world: int, shards: int, reshard: bool, decisions: dict, replicated: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = preset.build()
    model.train()
    for path, decision in decisions.items():  # the plan autoconfigure chose for this configuration
        decision.apply(model.get_submodule(path), name=path)
    if shards == 1 and replicated == "ddp":
        return DDP(model)
    # hybrid (and replicated on memfit's units): a replicas x shards mesh, one per shape
    if shards < world and shards not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[shards] = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    return memfit.FullyShardedDataParallel(
        model, auto_wrap_policy={preset.layer_class()}, reshard_after_forward=reshard, mesh=_MESHES.get(shards)
    )


_MESHES: dict[int, object] = {}


def _step(model, opt, batches: list[dict], replicated: bool) -> None:
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        with model.no_sync() if replicated and not last else contextlib.nullcontext():  # replicated: reduce once
            model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(fn) -> float:
    """Seconds of ``fn`` between barriers on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _measure(rank, world, preset, configs, warmup, repeats, replicated) -> list[tuple[float, int, float]]:
    """Per configuration, the median step time, the largest peak of any rank's last step and the
    spread of the step times (their interquartile range over the median).
    Every configuration is built first and the steps run in rounds, so that the machine's slow
    spells (another process, the ranks' skew) fall on all of them alike, not on whichever ran
    then; in a round each configuration runs two steps and the second is timed: a training
    job's step follows its own last step, not another model's (which leaves the caches and the
    allocator to that model: timed straight after one, BERT replicated over 4 ranks measured
    105.5 to 120.5 ms, 99.9 ms after its own)."""
    runs = [_step_of(rank, world, preset, replicated, c) for c in configs]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(warmup + repeats - 1):
        for took, step in zip(times, runs):
            step()
            took.append(_timed(step))
    out = []
    for took, step in zip(times, runs):
        model, opt = step.args[:2]
        step()
        with memfit.MemoryMeter(model=model, optimizer=opt) as meter:
            took.append(_timed(step))
        peak = torch.tensor([meter.peak_bytes])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        q1, _, q3 = statistics.quantiles(took[warmup:], n=4) if len(took[warmup:]) > 1 else (0.0, 0.0, 0.0)
        out.append((statistics.median(took[warmup:]), int(peak.item()), (q3 - q1) / statistics.median(took[warmup:])))
    return out


def _step_of(rank: int, world: int, preset: Preset, replicated: str, c):
    """One training step of the configuration ``c`` (AutoConfig.measure's step_of), built as the grid's."""
    model = _build(preset, world, c.layout.shard_size, c.layout.reshard_after_forward, _decisions(c.plan), replicated)
    opt = torch.optim.AdamW(model.parameters())
    a = c.accumulation
    batches = [batch_at(preset.arch, c.micro_batch, preset.shape.seq, step=rank * a + k) for k in range(a)]
    return functools.partial(_step, model, opt, batches, c.layout.shard_size == 1)


def _worker(rank: int, world: int, presets: dict[str, Preset], args) -> dict:
    t0 = time.perf_counter()
    profile = calibrate_group()
    out = {"profile": profile, "calibration_s": time.perf_counter() - t0, "models": {}}
    for name, preset in presets.items():
        box = [None]
        if rank == 0:
            box = [_search(preset, world, profile, args)]
        dist.broadcast_object_list(box)
        result, searched = box[0]
        fits = [c for c in result.candidates if c.fits]
        measured = _measure(rank, world, preset, fits, args.warmup, args.repeats, args.replicated)
        tried = None
        if args.trials:  # memfit's own trial of the top configurations (AutoConfig.measure), after the grid
            t0 = time.perf_counter()
            step_of = functools.partial(_step_of, rank, world, preset, args.replicated)
            tried = (result.measure(step_of, top=args.trials), time.perf_counter() - t0)
        out["models"][name] = (result, searched, measured, tried)
    return out


def _search(preset: Preset, world: int, profile, args):
    torch.manual_seed(0)
    model = preset.build()
    batch = batch_at(preset.arch, 1, preset.shape.seq, step=0)
    t0 = time.perf_counter()
    result = memfit.autoconfigure(
        model,
        batch,
        budget=args.budget,
        world_size=world,
        global_batch=args.global_batch,
        device_profile=profile,
        chunk_head=False,
        decisions=("keep", "selective", "full"),
    )
    return result, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,gpt2,llama")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--budget", default="40MB")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--trials", type=int, default=4, help="AutoConfig.measure's top: configurations tried (0: none)")
    p.add_argument("--replicated", choices=["ddp", "memfit"], default="memfit", help="what runs replicated layouts")
    p.add_argument("--out")
    args = p.parse_args()
    shape = Shape(layers=args.layers, hidden=args.hidden, heads=4, seq=args.seq, batch=1, vocab=args.vocab, dropout=0.0)
    presets = {name: Preset(name, shape) for name in args.models.split(",")}
    lines = _header(args, shape)
    for w in (int(x) for x in args.worlds.split(",")):
        lines += _report(args, w, spawn(_worker, w, presets, args))
    lines += [f"Load average at the end: {os.getloadavg()[0]:.1f} (2 cores).", ""]
    emit(lines, args.out)


def _header(args, shape) -> list[str]:
    return [
        "# memfit.autoconfigure: predicted vs measured on gloo ranks (CPU)",
        "",
        command("autoconfig.py"),
        "",
        f"Models: {args.models} (transformers, random init), {shape}; fp32, AdamW; global batch {args.global_batch}, "
        f"budget {args.budget} per rank. Time priced on this machine's profile measured by each group's ranks "
        f"together (memfit calibrate_group). torch {torch.__version__}, {os.cpu_count()} CPU cores shared by the "
        f"ranks. Step: median of {args.repeats} after {args.warmup} warm-up, between barriers (slowest rank), "
        "a model's configurations in rounds (two steps of each per round, the second timed); "
        "peak: the largest rank's MemoryMeter peak over the last step. Replicated rows run "
        + ("as torch DDP." if args.replicated == "ddp" else "on memfit's units over a W x 1 mesh."),
        "",
    ]


def _report(args, world: int, out: dict) -> list[str]:
    prof = out["profile"]
    lines = [
        f"## {world} ranks",
        "",
        f"Calibration ({out['calibration_s']:.0f} s): fp32 matmul {prof.flops['float32'] / 1e9:.1f} GFLOP/s per rank, "
        f"matmul latency {prof.matmul_latency * 1e6:.1f} us, memory {prof.memory_bandwidth / 1e9:.1f} GB/s, op "
        f"overhead {prof.op_overhead * 1e6:.1f} us; link {prof.intra_node_bandwidth / 1e9:.2f} GB/s, "
        f"{prof.intra_node_latency * 1e6:.0f} us per ring step"
        + "".join(f"; {g}-rank groups {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us" for g, lat, bw in prof.group_links)
        + f"; collective_overlap {prof.collective_overlap:.2f}; on the compute thread, per collective and per "
        "byte sent (as a multiple of its link time) beyond that: "
        + (
            ", ".join(
                f"{_layout_name(s, world)} {a * 1e3:.2f} ms and {b * prof.intra_node_bandwidth:.2f}x"
                for s, a, b in prof.layout_overheads
            )
            or "none measured"
        )
        + " (compute figures the median of the ranks').",
        "",
        "| model | micro | accum | layout | predicted ms | measured ms | spread | measured / predicted "
        "| measured / (predicted x trial scale) | rank predicted | rank measured | predicted peak MiB "
        "| measured peak MiB |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for name, (result, searched, measured, tried) in out["models"].items():
        fits = [c for c in result.candidates if c.fits]
        by_measured = sorted(range(len(fits)), key=lambda i: measured[i][0])
        rank_measured = {i: r + 1 for r, i in enumerate(by_measured)}
        # each point's measured step over its price x the trials' scale (None: no trials)
        scaled = (
            None
            if tried is None
            else [measured[i][0] / (c.step_time * tried[0].trial_scale) for i, c in enumerate(fits)]
        )
        for i, c in enumerate(fits):
            t, peak, spread = measured[i]
            ratio = "-" if scaled is None else f"{scaled[i]:.2f}"
            lines.append(
                f"| {name} | {c.micro_batch} | {c.accumulation} | {c.layout.describe()} | {c.step_time * 1e3:.1f} "
                f"| {t * 1e3:.1f} | {spread:.0%} | {t / c.step_time:.2f} | {ratio} | {i + 1} | {rank_measured[i]} "
                f"| {c.peak / MIB:.2f} | {peak / MIB:.2f} |"
            )
        best = by_measured[0]
        ratios = [measured[i][0] / c.step_time for i, c in enumerate(fits)]
        over = [c for i, c in enumerate(fits) if measured[i][1] > result.budget]
        summary.append(
            f"- {name}: {len(fits)} configurations run ({len(result.candidates) - len(fits)} priced over the budget); "
            f"pick {fits[0].micro_batch} x {fits[0].accumulation}, {fits[0].layout.describe()}: measured "
            f"{measured[0][0] * 1e3:.1f} ms, best {fits[best].micro_batch} x {fits[best].accumulation}, "
            f"{fits[best].layout.describe()}: {measured[best][0] * 1e3:.1f} ms (pick / best "
            f"{measured[0][0] / measured[best][0]:.3f}); measured / predicted {min(ratios):.2f} to {max(ratios):.2f} "
            f"(median {statistics.median(ratios):.2f}, {sum(abs(r - 1) <= 0.15 for r in ratios)} within 15%); "
            f"over the budget when run: {len(over)}; search {searched:.1f} s"
        )
        if tried is not None and scaled is not None:
            after, seconds = tried
            same = [i for i, c in enumerate(fits) if _key(c) == _key(after.best)]
            grid = measured[same[0]][0]
            out_of_trial = [r for r, c in zip(scaled, fits) if not any(_key(c) == _key(t) for t in fits[: args.trials])]
            summary.append(
                f"  - after trying the top {args.trials} (AutoConfig.measure, {seconds:.1f} s): pick "
                f"{after.best.micro_batch} x {after.best.accumulation}, {after.best.layout.describe()} "
                f"(trial {after.best.measured * 1e3:.1f} ms); in the grid {grid * 1e3:.1f} ms, pick / best "
                f"{grid / measured[best][0]:.3f}; trial scale {after.trial_scale:.2f}, weight "
                f"{after.trial_weight:.2f}: measured / (predicted x "
                f"scale) {min(scaled):.2f} to {max(scaled):.2f}, {sum(abs(r - 1) <= 0.15 for r in scaled)} of "
                f"{len(scaled)} within 15% ({sum(abs(r - 1) <= 0.15 for r in out_of_trial)} of {len(out_of_trial)} "
                "not tried)"
            )
    return [*lines, "", *summary, ""]


def _key(c) -> tuple:
    return c.micro_batch, c.accumulation, c.layout


def _layout_name(shards: int, world: int) -> str:
    return "fully sharded" if shards == world else "replicated" if shards == 1 else f"hybrid {world // shards}x{shards}"


if __name__ == "__main__":
    main()
