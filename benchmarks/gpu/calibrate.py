"""Part i: the time model calibrated on the device (``memfit calibrate``'s measurement, in process).

On CUDA it runs ``memfit._plan._calibrate_device.calibrate_device`` ([Note: Calibrating an
accelerator]), which also writes ``profile_<name>.json`` (h100, h200, a100) under ``--out``: the
file the named profile reads once committed to benchmarks/results/.

``memfit._plan._calibrate.calibrate(device, save=False)`` measures the rates the planner's time
model prices a step with (matmul rate and latency per dtype, memory bandwidth, offload
bandwidth, the cost per op of a tiny step and of checkpointing a block). Figures: every rate,
and its ratio to the named profile the planner uses for this device when none is given (for an
H200, PROFILES["h200"]); the profile is written beside the results as
``device-<name>.json``, the file ``memfit calibrate`` caches, so that a later session can
plan with the measured rates (``MEMFIT_CACHE_DIR=<there> memfit plan ... --device-profile
calibrated``). Goals: every rate positive and finite; the named profile's matmul rates and
bandwidth within a factor of 2 of the measured ones (a named profile further off prices every
plan wrong). Smoke: no measurement (calibrating takes minutes on a loaded CPU): the named CPU
profile stands in for it, so the comparison, the table and the file are what the smoke run
checks; its figures say ``"measured": false``.
"""

from __future__ import annotations

import dataclasses
import json
import math

from benchmarks.gpu._env import Env, device_name, fmt, goal
from memfit._plan._calibrate import calibrate
from memfit._plan._time import default_profile

COMPARED = ("memory_bandwidth", "offload_bandwidth", "op_overhead", "matmul_latency")


def run(env: Env) -> dict:
    named = default_profile(env.device)
    written = None  # the named profile's calibration file (CUDA: memfit calibrate's own measurement)
    if env.smoke:
        measured = named
    elif env.cuda:
        from memfit._plan._calibrate_device import calibrate_device

        measured, written = calibrate_device(env.device, results=env.out)
    else:
        measured = calibrate(env.device, save=False)
    ratios = {f"flops/{k}": _ratio(v, named.flops.get(k)) for k, v in measured.flops.items()}
    ratios |= {k: _ratio(getattr(measured, k), getattr(named, k, None)) for k in COMPARED}
    path = env.out / f"device-{device_name(env.device)}.json"
    path.write_text(json.dumps(dataclasses.asdict(measured), indent=1, default=str))
    rates = [*measured.flops.values(), measured.memory_bandwidth, measured.offload_bandwidth]
    close = [ratios[f"flops/{k}"] for k in measured.flops] + [ratios["memory_bandwidth"]]
    goals = [
        goal("rates measured", len(rates), "every one > 0 and finite", all(r > 0 and math.isfinite(r) for r in rates)),
        goal(
            f"named profile {named.name!r} within 2x of the measurement",
            max((max(r, 1 / r) for r in close if r), default=None),
            "matmul rates and bandwidth within 2x",
            all(r is not None and 0.5 <= r <= 2 for r in close),
        ),
    ]
    md = [
        f"- calibrated on {env.device} against the named profile {named.name!r} (measured / named), "
        f"written to `{path.name}`:",
        "",
        "| rate | measured | named | measured / named |",
        "|---|---:|---:|---:|",
    ]
    for key, r in ratios.items():
        sub = key.partition("/")[2]
        got = measured.flops[sub] if sub else getattr(measured, key)
        had = named.flops.get(sub) if sub else getattr(named, key, None)
        md.append(f"| {key} | {got:.4g} | {'-' if had is None else format(had, '.4g')} | {fmt(r)} |")
    figures = {"profile": dataclasses.asdict(measured), "named": named.name, "ratios": ratios, "file": str(path)}
    figures["profile_file"] = None if written is None else str(written)  # commit as benchmarks/results/
    if written is not None:
        md.append(f"- the named profile's calibration: `{written.name}` (copy it to benchmarks/results/)")
    figures["measured"] = not env.smoke
    if env.smoke:
        md.insert(0, "- smoke: not measured; the named profile stands in for the measurement")
    return {"figures": json.loads(json.dumps(figures, default=str)), "goals": goals, "markdown": md}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b
