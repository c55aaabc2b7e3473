"""Part c: sharding at W=1 on NCCL (gloo on the CPU in smoke mode): plain vs torch FSDP2
(``fully_shard`` per layer, then the root) vs memfit (``FullyShardedDataParallel`` with the
layer class as its wrap policy), fp32 and bf16 mixed precision (plain: bf16 autocast; FSDP2:
``MixedPrecisionPolicy(bf16, fp32)``; memfit: ``MixedPrecision(bf16, reduce_dtype=fp32)``), on
BERT-large (seq 512, batch 8) and the llama-1b preset (seq 2048, batch 1). AdamW.

Figures: median step time of 5 steps after 2 warm-up, allocator peaks, and from one profiled
step (torch.profiler): device kernels, kernels per unit beyond plain, host-blocking sync calls
(cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize / blocking cudaMemcpy),
and the summed kernel time against the step's wall time (below 1: idle gaps; comms overlap is
not separated at W=1, where memfit runs no collectives). Goal: memfit's step <= 1.03x plain's
and <= FSDP2's.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import memfit
from benchmarks.gpu._env import Env, errors_of, fmt, goal, mib, profile_errors, ratio, timed_after_profiler
from benchmarks.gpu.bert import SMOKE
from memfit.models import PRESETS, Preset, lm_batch, mlm_batch

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def presets(env: Env) -> dict[str, Preset]:
    if env.smoke:
        return {
            "bert": Preset("bert", SMOKE),
            "llama": Preset("llama", dataclasses.replace(SMOKE, dropout=0.0)),
        }
    return {"bert-large": PRESETS["bert-large"], "llama-1b": PRESETS["llama-1b"]}


def wrap(strategy: str, model: torch.nn.Module, layer: type, bf16: bool) -> torch.nn.Module:
    if strategy == "plain":
        return model
    if strategy == "memfit":
        mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        return memfit.FullyShardedDataParallel(model, auto_wrap_policy=layer, mixed_precision=mp)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for m in [m for m in model.modules() if isinstance(m, layer)]:
        fully_shard(m, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def op_fixture(prof, tag: str, env: Env) -> dict:
    """The aten op stream one profiled step ran (names, in order of start) and per op class its
    host time and its kernels' device time (microseconds), as a fixture CPU tests can compare
    the planner's traced stream with: written to ``<out>/fixtures/ops_<tag>_<device>.json``."""
    import json

    from benchmarks.gpu._env import device_name

    aten = sorted((e for e in prof.events() if e.name.startswith("aten::")), key=lambda e: e.time_range.start)
    by_class = {}
    for a in prof.key_averages():
        if a.key.startswith("aten::"):
            device_us = getattr(a, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(a, "self_cuda_time_total", 0)
            by_class[a.key] = {"count": a.count, "host_us": a.self_cpu_time_total, "kernel_us": device_us}
    fixture = {"tag": tag, "device": device_name(env.device), "ops": [e.name for e in aten], "by_class": by_class}
    path = env.out / "fixtures" / f"ops_{tag}_{device_name(env.device)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fixture, indent=0))
    host_us = sum(c["host_us"] for c in by_class.values())
    return {"fixture": str(path.relative_to(env.out)), "ops": len(aten), "host_us": host_us}


def profile_step(env: Env, step, tag: str | None = None) -> dict:
    """One profiled call of ``step``. Kineto leaves CUPTI subscribed after a session unless
    TEARDOWN_CUPTI=1 (pytorch/pytorch#144455), and every kernel launch after it pays CUPTI's
    callbacks: the parts time all their rows before they profile any (see [Note: Time before
    profiling]), and this sets TEARDOWN_CUPTI=1 (unless set) so that a later part's timings do
    not pay for an earlier part's profiles either. The teardown has not run on a GPU yet."""
    import os

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    if env.cuda:
        os.environ.setdefault("TEARDOWN_CUPTI", "1")  # read by Kineto when the session stops
    env.profiler_sessions += 1
    env.sync()
    with profile(activities=activities) as prof:
        step()
        env.sync()
    events = prof.events()
    if env.cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels)
    else:  # the CPU: aten ops stand in for kernels
        kernels = [e for e in events if e.name.startswith("aten::")]
        busy = 0
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    out = {"kernels": len(kernels), "sync_calls": syncs, "kernel_us": busy}
    if tag is not None and env.out is not None:
        out |= op_fixture(prof, tag, env)
    return out


# [Note: Time before profiling]
# A torch.profiler session leaves CUPTI's callbacks on every later kernel launch in the process
# (pytorch/pytorch#144455): the first H100 run's part c timed bert-large bf16 plain at batch 8
# in 0.105 s after part b's and its own profiles, where part b's batch 16 took 0.083 s. So a
# part that times and profiles runs two passes: the first builds each row, times it, takes its
# allocator peaks and its peak snapshot (benchmarks/gpu/_memsnap.py), and frees it; only then
# the second builds each row again, warms it up one step and profiles it. Each timed row
# records ``profiler_sessions_before`` (the sessions this process ran before it was timed), and
# the part's ``timed_after_profiler`` lists the rows timed after a session of the part itself
# (none) and says how many sessions earlier parts ran (part c runs after part b in one call):
# for those, profile_step sets TEARDOWN_CUPTI=1, so that Kineto detaches CUPTI when a session
# ends.


def _build(env: Env, preset: Preset, strategy: str, bf16: bool, base: torch.nn.Module, batch: dict):
    model = wrap(strategy, copy.deepcopy(base).to(env.device), preset.layer_class(), bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = env.autocast(torch.bfloat16 if bf16 and strategy == "plain" else torch.float32)

    def step() -> None:
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _tag(preset: Preset, strategy: str, bf16: bool) -> str:
    return f"c-{preset.arch}-{'bf16' if bf16 else 'fp32'}-{strategy.replace(' ', '_')}"


def measure(env: Env, preset: Preset, strategy: str, bf16: bool, base: torch.nn.Module, batch: dict) -> dict:
    """The first pass: step time, allocator peaks and the peak's snapshot; no profiler."""
    from benchmarks.gpu._memsnap import record_peak

    before = env.profiler_sessions
    model, step = _build(env, preset, strategy, bf16, base, batch)
    warmup, repeats = (0, 1) if env.smoke else (2, 5)
    seconds = env.median_time(step, warmup, repeats)
    peaks = env.allocator_peaks(step) if env.cuda else {"max_allocated": None, "max_reserved": None}
    snapshot = record_peak(env, step, _tag(preset, strategy, bf16))
    units = sum(1 for m in model.modules() if isinstance(m, preset.layer_class())) + 1
    return {"step_s": seconds, **peaks, "units": units, "profiler_sessions_before": before, "peak_snapshot": snapshot}


def profile_row(env: Env, preset: Preset, strategy: str, bf16: bool, base: torch.nn.Module, batch: dict, row: dict):
    """The second pass: the row built again, one warm-up step, one profiled step."""
    _, step = _build(env, preset, strategy, bf16, base, batch)
    step()
    prof = profile_step(env, step, _tag(preset, strategy, bf16))
    return {**prof, "busy_share": prof["kernel_us"] / 1e6 / row["step_s"]}


def run(env: Env) -> dict:
    sessions_at_start = env.profiler_sessions
    results: dict[str, dict] = {}
    goals, md = [], []
    rows_of: list[tuple] = []  # (label, strategy, preset, bf16, base, batch): the rows, timed then profiled
    with env.process_group():
        for name, preset in presets(env).items():
            base = preset.build()
            make = mlm_batch if preset.arch == "bert" else lm_batch
            batch = {k: v.to(env.device) for k, v in make(preset.shape).items()}
            for bf16 in (False, True) if not (env.smoke and preset.arch == "llama") else (False,):
                label = f"{name} {'bf16' if bf16 else 'fp32'}"
                smoke_llama = env.smoke and preset.arch == "llama"  # smoke: the preset's path, once
                for strategy in ("memfit",) if smoke_llama else ("plain", "torch FSDP2", "memfit"):
                    rows_of.append((label, strategy, preset, bf16, base, batch))
        for label, strategy, preset, bf16, base, batch in rows_of:  # See [Note: Time before profiling]
            env.log(f"  c: {label} {strategy}")
            rows = results.setdefault(label, {})
            try:
                rows[strategy] = measure(env, preset, strategy, bf16, base, batch)
            except Exception as e:  # recorded; the others still run
                rows[strategy] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            env.free()
        for label, strategy, preset, bf16, base, batch in rows_of:
            r = results[label][strategy]
            if "error" in r:
                continue
            env.log(f"  c: {label} {strategy} (profiled)")
            try:
                r |= profile_row(env, preset, strategy, bf16, base, batch, r)
            except Exception as e:  # recorded; the others still run
                r["profile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            env.free()
        del rows_of, base, batch
    md += [
        "Median of 5 steps after 2 warm-up; one profiled step for the counts, after every row was timed.",
        "",
        "| model | strategy | step s | vs plain | max allocated MiB | max reserved MiB | kernels | kernels/unit "
        "beyond plain | sync calls | kernel time / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, rows in results.items():
        plain = rows.get("plain", {})
        for strategy, r in rows.items():
            if "error" in r:
                md.append(f"| {label} | {strategy} | {r['error']} ||||||||")
                continue
            k, k0 = r.get("kernels"), plain.get("kernels")  # None: the profiled pass failed
            extra = (k - k0) / r["units"] if k is not None and k0 is not None else None
            md.append(
                f"| {label} | {strategy} | {r['step_s']:.4f} | {fmt(ratio(r['step_s'], plain.get('step_s')))} "
                f"| {mib(r['max_allocated'])} | {mib(r['max_reserved'])} | {fmt(k)} | {fmt(extra, 1)} "
                f"| {fmt(r.get('sync_calls'))} | {fmt(r.get('busy_share'), 2)} |"
            )
        mem, fsdp = rows.get("memfit", {}), rows.get("torch FSDP2", {})
        if "step_s" in mem and "step_s" in plain:
            t = mem["step_s"] / plain["step_s"]
            goals.append(goal(f"{label}: memfit vs plain", t, "<= 1.03", t <= 1.03))
        else:
            goals.append(goal(f"{label}: memfit and plain ran", None, "no error", False))
        if "step_s" in mem and "step_s" in fsdp:
            t = mem["step_s"] / fsdp["step_s"]
            goals.append(goal(f"{label}: memfit vs FSDP2", t, "<= 1.00", t <= 1.0))
    figures = {"results": results, "errors": errors_of(results) | profile_errors(results)}
    figures["timed_after_profiler"] = timed_after_profiler(results, sessions_at_start)
    return {"figures": figures, "goals": goals, "markdown": md}
