"""The planner, measured: forecast error (one process and sharded), the planner's own peak
memory, planning time, and predicted against measured step time, per model; then the CLI's
real-size plans (llama-8b on 8 GPUs, bert-large, gpt2-xl, llama-70b on 64) with their
model-state terms beside DeepSpeed's estimate_zero3_model_states_mem_needs.

Single process (CPU, fp32, AdamW): budgets at 25/50/75% of the way from the all-full plan's
measured peak to keep-all's; each plan trains a copy for 2 steps and MemoryMeter measures the
last. Step time: one thread, process CPU time (so that other processes on a shared machine
count less), median of 5 steps after 1 warm-up, keep-all and all-full, against the forecast
priced on `memfit calibrate`'s profile measured in the same run the same way (cpu_time=True),
just before each model; the load average is reported. Measured with glibc's malloc told not to
give freed heap memory back to the system (mallopt M_TRIM_THRESHOLD) and to map blocks of
32 MiB and more afresh (M_MMAP_THRESHOLD, its largest value, fixed): with its defaults the
same step faults in 0 to 125 MiB of pages again each step (see [Note: Page faults and the
measured step]), which is also measured and reported first. Sharded: keep-all and all-full
on W = 2 and 4 gloo ranks (memfit.FullyShardedDataParallel, each layer a unit), the largest
per-rank peak of the second step.

    .venv/bin/python benchmarks/planner.py [--out benchmarks/results/planner.md]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import resource
import statistics
import time

import torch
from _common import MIB, command, emit, progress_log

import memfit
from memfit._plan._calibrate import calibrate
from memfit._plan._profile_types import BlockProfile, ModelProfile
from memfit._plan._solve import forecast, solve
from memfit._plan._validate import measured_sharded_peak
from memfit.models import PRESETS, Preset, Shape, lm_batch, mlm_batch
from memfit.testing import spawn

GIB = 2**30
SMALL = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "batch": 4, "dropout": 0.0}
MODELS = {
    "BERT-MLM 8k": Preset("bert", Shape(vocab=8192, **SMALL)),
    "GPT-2 8k (tied)": Preset("gpt2", Shape(vocab=8192, **SMALL)),
    "Llama 8k": Preset("llama", Shape(vocab=8192, **SMALL)),
    "Llama 32k": Preset("llama", Shape(vocab=32000, **SMALL)),
}


def batch_of(preset: Preset, seed: int = 0) -> dict:
    return (mlm_batch if preset.arch == "bert" else lm_batch)(preset.shape, seed=seed)


# [Note: Page faults and the measured step]
# glibc's malloc gives the free memory at the top of its heap back to the system once more than
# its trim threshold is free, and maps blocks above its mmap threshold (which it moves, up to
# 32 MiB, as such blocks are freed) afresh each time; PyTorch's CPU allocator has no cache, so
# the next step touches those pages again and the kernel faults and zeroes each one (system
# time: process CPU time counts it). How much a step faults depends on the order of frees and
# varies from run to run for the same step (Llama 32k all-full: 94 then 62 MiB; BERT-MLM
# all-full: 0 then 20 MiB), and each faulted MiB cost 0.5 to 1.9 ms of system time depending on
# the load. No count of a step's operations predicts it, so the step time is compared where the
# allocator reuses its memory (trimming off, the mmap threshold fixed at its 32 MiB maximum:
# blocks that large still fault, and the time model prices them: see DeviceProfile.fresh_*),
# and the default allocator's step time and faults are reported beside it.
_LIBC = ctypes.CDLL(None)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def reuse_heap() -> None:
    """glibc: keep freed heap memory (no trimming), map only blocks of 32 MiB or more afresh."""
    if not (_LIBC.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and _LIBC.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)):
        raise RuntimeError("mallopt failed: not glibc?")


def step_time(model, batch, plan, steps: int = 5) -> tuple[float, float, float]:
    """Median process CPU seconds of a step (one thread: see the module's docstring), median
    minor page faults per step in MiB, and the fastest step's seconds."""
    m = plan.apply(copy.deepcopy(model))
    m.train()
    opt = torch.optim.AdamW(m.parameters())
    times, faults = [], []
    for i in range(steps + 1):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.process_time() - t0)
            faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) * resource.getpagesize() / MIB)
    return statistics.median(times), statistics.median(faults), min(times)


def one_thread(fn, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def step_times(cases: dict, log) -> list[str]:
    """Per model: keep-all and all-full measured with glibc's defaults (all models first, before
    mallopt changes them for the process), then with the heap reused against the forecast
    priced on a calibration made just before, in the same regime."""
    default = {}
    for name, (model, batch, paths, profile) in cases.items():
        for k in ("keep", "full"):
            plan = memfit.Plan.fixed(dict.fromkeys(paths, k), profile)
            default[name, k] = one_thread(step_time, model, batch, plan)
    reuse_heap()
    rows = []
    for name, (model, batch, paths, profile) in cases.items():
        device = one_thread(lambda: calibrate("cpu", save=False, cpu_time=True))
        load = os.getloadavg()[0]
        repriced = memfit.plan(model, batch, budget="1TB", device_profile=device).profile
        rates = f"{device.flops['float32'] / 1e9:.0f} / {device.op_overhead * 1e6:.1f}"
        for k in ("keep", "full"):
            plan = memfit.Plan.fixed(dict.fromkeys(paths, k), profile)
            measured, faults, fastest = one_thread(step_time, model, batch, plan)
            predicted = memfit.Plan.fixed(dict.fromkeys(paths, k), repriced).predicted_step_time
            d_time, d_faults, _ = default[name, k]
            rows.append(
                f"| {name} | {k} all | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
                f"{predicted / measured - 1:+.1%} | {fastest * 1e3:.1f} | {predicted / fastest - 1:+.1%} | "
                f"{faults:.0f} | {d_time * 1e3:.1f} | {d_faults:.0f} | {rates} | {load:.1f} |"
            )
        log(f"{name}: step times")
    return [
        "## Step time: predicted against measured",
        "",
        "One thread, process CPU time, median of 5 steps (and the fastest of them: calibration takes the fastest of "
        "its repeats, so under load the median runs above what it prices); predicted on `memfit calibrate`'s rates "
        "measured in this run just before each model (CPU time, one thread). Measured with glibc's heap reused "
        "(trimming off, "
        "mmap threshold fixed at 32 MiB); beside it, the same step with glibc's defaults measured earlier in "
        "this run, and the pages each step faulted in (see [Note: Page faults and the measured step] in "
        "benchmarks/planner.py).",
        "",
        "| model | strategy | predicted ms | measured ms | error | fastest ms | error | faulted MiB | "
        "default malloc: measured ms | faulted MiB | calibrated GFLOP/s / us per op | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def single(name: str, preset: Preset, device, log, cases: dict) -> list[str]:
    model, batch = preset.build(), batch_of(preset)
    t0 = time.perf_counter()
    with memfit.MemoryMeter() as meter:
        probe = memfit.plan(model, batch, budget="1TB", device_profile=device)
    seconds = time.perf_counter() - t0
    profile, paths = probe.profile, list(probe.decisions)
    keep = memfit.Plan.fixed(dict.fromkeys(paths, "keep"), profile)
    full = memfit.Plan.fixed(dict.fromkeys(paths, "full"), profile)
    keep_peak, full_peak = keep.measure(model, batch), full.measure(model, batch)
    rows = [("keep all", keep, keep_peak, None), ("full all", full, full_peak, None)]
    if profile.head_chunked is not None:  # the head and loss chunked too (memfit.chunked_cross_entropy)
        chunked = memfit.Plan.fixed(dict.fromkeys(paths, "full"), profile, head="chunked")
        rows.append(("full all + chunked head", chunked, chunked.measure(model, batch), None))
    for f in (0.25, 0.5, 0.75):
        budget = int(full_peak + f * (keep_peak - full_peak))
        p = memfit.plan(model, batch, budget=budget, profile=profile, device_profile=device)
        rows.append((f"plan @{int(f * 100)}%", p, p.measure(model, batch), budget))
    log(f"{name}: planned in {seconds:.1f}s, measured peaks")
    cases[name] = (model, batch, paths, profile)
    lines = [
        f"### {name}",
        "",
        f"Planning: {seconds:.2f} s, planner's own tensor peak {meter.peak_bytes} B (MemoryMeter around "
        f"memfit.plan; blocks profiled: {profile.distinct_blocks} of {len(paths)}).",
        "",
        "| strategy | keep/sel/full/offl | budget MiB | predicted MiB | measured MiB | error | fits |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, p, measured, budget in rows:
        counts = "/".join(str(list(p.decisions.values()).count(d)) for d in ("keep", "selective", "full", "offload"))
        counts += " + chunked head" if p.head == "chunked" else ""
        fits = "-" if budget is None else ("yes" if measured <= budget else "NO")
        b = f"{budget / MIB:.2f}" if budget else "-"
        lines.append(
            f"| {label} | {counts} | {b} | {p.predicted_peak / MIB:.2f} | {measured / MIB:.2f} | "
            f"{p.predicted_peak / measured - 1:+.1%} | {fits} |"
        )
    return [*lines, ""]


def _sharded_worker(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        preset = MODELS[name]
        model, batch = preset.build(), batch_of(preset, seed=rank)
        probe = memfit.plan(model, batch, budget="1TB", world_size=world, device_profile="cpu")
        for kind in ("keep", "full"):
            plan = memfit.Plan.fixed(dict.fromkeys(probe.decisions, kind), probe.profile, probe.sharding)
            out[(name, kind)] = (plan.predicted_peak, measured_sharded_peak(plan, model, batch, preset.layer_class()))
    return out


def sharded(log) -> list[str]:
    lines = [
        "## Sharded forecasts (per rank, largest over ranks)",
        "",
        "| model | W | keep: predicted / measured MiB | error | full: predicted / measured MiB | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for world in (2, 4):
        res = spawn(_sharded_worker, world, list(MODELS))
        log(f"sharded W={world} done")
        for name in MODELS:
            (pk, mk), (pf, mf) = res[(name, "keep")], res[(name, "full")]
            lines.append(
                f"| {name} | {world} | {pk / MIB:.2f} / {mk / MIB:.2f} | {pk / mk - 1:+.1%} | "
                f"{pf / MIB:.2f} / {mf / MIB:.2f} | {pf / mf - 1:+.1%} |"
            )
    return [*lines, ""]


def deepspeed_zero3_gpu_bytes(model: torch.nn.Module, world: int) -> tuple[int, int]:
    """DeepSpeed's estimate_zero3_model_states_mem_needs without offload: 4 x largest layer
    (its own parameters) + 18 x parameters / GPUs; with its inputs."""
    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return 4 * largest + 18 * total // world, total


def real_sizes(log) -> list[str]:
    cases = [
        ("llama-8b", 8, "80GB", "bf16", "h100"),
        ("bert-large", 8, "16GB", "fp32", "a100"),
        ("gpt2-xl", 8, "40GB", "bf16", "a100"),
        ("llama-70b", 64, "80GB", "bf16", "h100"),
    ]
    lines = [
        "## Real sizes on this machine (meta device, fake tensors)",
        "",
        "`memfit plan --model M --world-size W --budget B --dtype D --device-profile P`; CPU seconds of "
        "memfit.plan (process CPU time; wall time depends on the load of this shared 2-core machine), "
        "the per-rank forecast, and the model-state terms beside DeepSpeed's ZeRO-3 estimate.",
        "",
        "| model | W | budget | dtype | plan CPU s | wall s | predicted peak GiB | smallest budget GiB | "
        "memfit model states GiB | DeepSpeed GiB |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    from memfit._plan._solve import smallest_budget
    from memfit.cli._data import batch_at
    from memfit.cli._plan import DTYPES

    for name, world, budget, dtype, device in cases:
        preset = PRESETS[name]
        with torch.device("meta"):
            model = preset.build().to(DTYPES[dtype])
        batch = batch_at(preset.arch, preset.shape.batch, preset.shape.seq, step=0)
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            plan = memfit.plan(model, batch, budget=budget, world_size=world, device_profile=device)
            peak = f"{plan.predicted_peak / GIB:.2f}"
            profile, sharding = plan.profile, plan.sharding
        except memfit.PlanError:
            probe = memfit.plan(model, batch, budget="1PB", world_size=world, device_profile=device)
            peak, profile, sharding = "no fit", probe.profile, probe.sharding
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        floor = smallest_budget(profile, sharding)
        t = memfit.testing.terms(profile, sharding)
        ours = t["state"] + t["gather_buffers"] + t["unit_buffers"]
        ds, _ = deepspeed_zero3_gpu_bytes(model, world)
        log(f"{name}: {cpu:.1f} s CPU")
        lines.append(
            f"| {name} | {world} | {budget} | {dtype} | {cpu:.1f} | {wall:.1f} | {peak} | {floor / GIB:.2f} | "
            f"{ours / GIB:.2f} | {ds / GIB:.2f} |"
        )
    return [*lines, ""]


def solver_time(n_blocks: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(n_blocks):
        keep = int(torch.randint(800, 1200, (1,), generator=g))
        kept = {"keep": keep, "selective": keep // 2, "full": 100, "offload": 10}
        extra = {"keep": 0.0, "selective": 0.003, "full": 0.01, "offload": 0.015}
        blocks.append(
            BlockProfile(f"b{i}", 400, 400, 100, 100, kept, {d: v + 2000 for d, v in kept.items()}, 0.01, extra)
        )
    profile = ModelProfile(blocks, 10**6, 4 * 10**5, 6 * 10**5, 500, 300, 100, 3000, 10**6)
    budget = int(
        (forecast(profile, ["offload"] * n_blocks)["peak"] + forecast(profile, ["keep"] * n_blocks)["peak"]) / 2
    )
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert solve(profile, budget) is not None
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--skip-sharded", action="store_true")
    args = p.parse_args()
    log = progress_log()
    device = "cpu"  # memory forecasts do not depend on it; step times are priced per model below
    lines = [
        "# The planner, measured",
        "",
        command("planner.py"),
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Shapes {Shape(**SMALL)} with the vocabulary "
        f"named. Load average at the start (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "",
        "## One process",
        "",
    ]
    cases: dict = {}
    for name, preset in MODELS.items():
        lines += single(name, preset, device, log, cases)
    at = len(lines)  # the step times go here, measured last: mallopt changes the rest of the process
    if not args.skip_sharded:
        lines += sharded(log)
    lines += real_sizes(log)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    lines += [
        f"Solver: {solver_time() * 1e3:.1f} ms (median of 5) for a 200-block chain. Max RSS of this "
        f"process: {rss:.0f} MiB (every plan above included).",
        "",
    ]
    lines[at:at] = step_times(cases, log)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
