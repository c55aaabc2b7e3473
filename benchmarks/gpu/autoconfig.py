"""Part g: memfit.autoconfigure's pick tried on the device (AutoConfig.measure), one process.

GPT-2 small (the gpt2-small preset, seq 1024, fp32, AdamW; smoke: the tiny gpt2 preset on the
CPU), global batch 32, a budget of 16 GiB (smoke: 1 GB), time priced on the device's named
profile. The top TOP = 6 configurations that fit run for real: each built afresh with its plan's
checkpoint decisions, 2 warm-up steps, the median of 5 (AutoConfig.measure, the allocator's peak
read). Figures: per configuration tried, the predicted and measured step time and the forecast
and allocator peaks. Goals: the pick's allocator peak within the budget, each measured step
within 15% of its price (the time model has not been checked on a GPU before this part), the
trial under 60 s, at least TOP configurations ranked (or every one that fits).
"""

from __future__ import annotations

import time

import torch

import memfit
from benchmarks.gpu._env import Env, fmt, goal, mib
from memfit._plan._time import default_profile
from memfit.cli._data import batch_at
from memfit.models._spec import loss_of, resolve, settle_loss_type

TOP = 6  # configurations tried on the device (issue 48: at least 6 ranked)


def run(env: Env) -> dict:
    spec = resolve("gpt2", layers=2, hidden=32, seq=16) if env.smoke else resolve("gpt2-small")
    budget, global_batch = ("1GB", 8) if env.smoke else ("16GiB", 32)
    example = batch_at(spec.arch, 1, spec.seq, step=0)
    model = spec.build(0)
    settle_loss_type(model)
    t0 = time.perf_counter()
    profile = default_profile("cuda" if env.cuda else "cpu")
    result = memfit.autoconfigure(
        model, example, budget=budget, world_size=1, global_batch=global_batch, device_profile=profile
    )
    searched = time.perf_counter() - t0
    del model

    def step_of(c):
        model = spec.build(0)
        settle_loss_type(model)
        c.plan.apply(model)
        model = model.to(env.device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        rows = [
            {k: v.to(env.device) for k, v in batch_at(spec.arch, c.micro_batch, spec.seq, step=k).items()}
            for k in range(c.accumulation)
        ]

        def step():
            for mb in rows:
                (loss_of(model, mb) / len(rows)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    t0 = time.perf_counter()
    tried = result.measure(step_of, top=TOP, device=env.device)
    took = time.perf_counter() - t0
    runs = [c for c in tried.candidates if c.measured is not None or c.lost.startswith("memory: out of")]
    ranked = len(runs) >= min(TOP, sum(c.plan is not None for c in tried.candidates))
    rows = [
        {
            "micro_batch": c.micro_batch,
            "accumulation": c.accumulation,
            "decisions": sorted(set(c.plan.decisions.values())) if c.plan else None,
            "head": c.plan.head if c.plan else None,
            "predicted_s": c.step_time,
            "measured_s": c.measured,
            "ratio": None if c.measured is None else c.measured / c.step_time,
            "forecast_peak": c.peak,
            "allocator_peak": c.measured_peak,
            "lost": c.lost,
        }
        for c in runs
    ]
    best = tried.best
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    figures = {
        "profile": profile.name,
        "budget": tried.budget,
        "search_s": searched,
        "trial_s": took,
        "predicted_pick": [result.best.micro_batch, result.best.accumulation],
        "measured_pick": [best.micro_batch, best.accumulation],
        "trial_scale": tried.trial_scale,  # median measured / predicted of the runs (AutoConfig.trial_scale)
        "trial_weight": tried.trial_weight,  # the measured steps' weight against the scaled price (near 1: repeatable)
        "tried": rows,
    }
    peak_ok = best.measured_peak is None or best.measured_peak <= tried.budget
    goals = [
        goal("the pick's allocator peak within the budget", best.measured_peak, f"<= {mib(tried.budget)} MiB", peak_ok),
        goal(
            "measured / predicted step, every configuration tried",
            max(ratios, key=lambda r: abs(r - 1), default=None),
            "within 0.85-1.15",
            bool(ratios) and all(0.85 <= r <= 1.15 for r in ratios),
        ),
        goal("the trial's time", took, "< 60 s", took < 60),
        goal("configurations ranked on the device", len(runs), f">= {TOP} (or every one that fits)", ranked),
    ]
    md = [
        f"- autoconfigure ({searched:.1f} s) then AutoConfig.measure of its top {TOP} ({took:.1f} s), "
        f"{'tiny gpt2 (smoke)' if env.smoke else 'gpt2-small, seq 1024'}, global batch {global_batch}, budget "
        f"{mib(tried.budget)} MiB, priced on {profile.name}: predicted pick {result.best.micro_batch} x "
        f"{result.best.accumulation}, measured pick {best.micro_batch} x {best.accumulation}",
        *(
            f"  - {r['micro_batch']} x {r['accumulation']} {r['decisions']} head {r['head']}: predicted "
            f"{fmt(r['predicted_s'] * 1e3)} ms, measured {fmt(r['measured_s'] * 1e3 if r['measured_s'] else None)} ms "
            f"(x{fmt(r['ratio'])}); forecast {mib(int(r['forecast_peak']))} MiB, "
            f"allocator {mib(r['allocator_peak'])} MiB"
            f"{'; ' + r['lost'] if r['lost'] else ''}"
            for r in rows
        ),
    ]
    return {"figures": figures, "goals": goals, "markdown": md}
