"""The planner on HF BERT-MLM and GPT-2 (CPU): forecasts against measured peaks, and planned
steps against uniform checkpointing at the same budget.

For each model: memfit.plan profiles the blocks once; budgets are set at 25, 50 and 75% of
the way from the measured peak with every layer checkpointed to the one with none. Each plan
and each uniform strategy (checkpoint every k-th layer) trains its own copy of the model in one
run (interleaved timed steps, then one MemoryMeter step each). Also: the solver's time on a
200-block chain.

    .venv/bin/python benchmarks/planner.py [--out benchmarks/results/planner_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _common import MIB, add_shape_args, command, emit, progress_log, run, shape_from

import memfit
from memfit.models import bert_mlm, gpt2_lm, lm_batch, mlm_batch
from memfit.testing import DECISIONS, BlockProfile, ModelProfile, forecast, solve


def uniform(paths: list[str], k: int) -> dict[str, str]:
    return {p: ("full" if i % k == 0 else "keep") for i, p in enumerate(paths)}


def bench_model(name, model, batch, warmup, repeats, log) -> list[str]:
    t0 = time.perf_counter()
    probe = memfit.plan(model, batch, budget="1TB")
    log(f"{name}: profiled in {time.perf_counter() - t0:.1f}s")
    profile = probe.profile
    paths = [b.path for b in profile.blocks]
    n = len(paths)
    ks = sorted({k for k in (1, 2, 3, n) if k <= n})
    plans = {"none (keep all)": memfit.Plan.fixed(dict.fromkeys(paths, "keep"), profile)}
    for k in ks:
        plans[f"uniform: every {k}" if k > 1 else "uniform: all full"] = memfit.Plan.fixed(uniform(paths, k), profile)

    def measured(plan):
        m = copy.deepcopy(model)
        m.train()
        return plan.apply(m)

    def peak_of(plan):
        return plan.measure(model, batch)

    keep_peak, full_peak = peak_of(plans["none (keep all)"]), peak_of(plans["uniform: all full"])
    budgets = {f"{int(f * 100)}%": int(full_peak + f * (keep_peak - full_peak)) for f in (0.25, 0.5, 0.75)}
    for label, budget in budgets.items():
        t0 = time.perf_counter()
        plans[f"plan @{label}"] = memfit.plan(model, batch, budget=budget, profile=profile)
        log(f"{name}: plan @{label} solved in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    results = dict(zip(plans, run({s: measured(p) for s, p in plans.items()}, batch, warmup, repeats, log)))
    base = results["none (keep all)"]

    lines = [
        f"## {name}",
        "",
        f"Budgets between all-full ({full_peak / MIB:.1f} MiB) and none ({keep_peak / MIB:.1f} MiB): "
        + ", ".join(f"{k} = {v / MIB:.1f} MiB" for k, v in budgets.items())
        + ". All rows trained in one run.",
        "",
        "| strategy | decisions (keep/sel/full/offl) | budget MiB | predicted MiB | measured MiB | forecast error "
        "| within 1.05x budget | step s | overhead vs none | fits 25% / 50% / 75% |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s, p in plans.items():
        r = results[s]
        counts = "/".join(str(list(p.decisions.values()).count(d)) for d in DECISIONS)
        err = p.predicted_peak / r.peak - 1
        budget = p.budget if s.startswith("plan") else None
        fits = " / ".join("yes" if r.peak <= b else "no" for b in budgets.values())
        lines.append(
            f"| {s} | {counts} | {budget / MIB if budget else float('nan'):.1f} | {p.predicted_peak / MIB:.1f} | "
            f"{r.peak / MIB:.1f} | {err:+.1%} | {'yes' if budget is None or r.peak <= 1.05 * budget else 'NO'} | "
            f"{r.time:.3f} | {r.time / base.time - 1:+.1%} | {fits} |"
        )
    lines.append("")
    for label, budget in budgets.items():
        p, r = plans[f"plan @{label}"], results[f"plan @{label}"]
        fitting = [(s, results[s]) for s in plans if s.startswith("uniform") and results[s].peak <= budget]
        best = min(fitting, key=lambda sr: sr[1].time) if fitting else None
        if best:
            lines.append(
                f"- @{label}: plan {r.time:.3f}s vs the fastest uniform strategy that fits ({best[0]}) "
                f"{best[1].time:.3f}s; predicted overheads {p.predicted_overhead * 1e3:.0f} ms vs "
                f"{plans[best[0]].predicted_overhead * 1e3:.0f} ms"
            )
    lines.append("")
    return lines


def solver_time(n_blocks: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(n_blocks):
        keep = int(torch.randint(800, 1200, (1,), generator=g))
        kept = {"keep": keep, "selective": keep // 2, "full": 100, "offload": 10}
        blocks.append(
            BlockProfile(
                f"b{i}",
                400,
                400,
                100,
                100,
                kept,
                {d: v + 2000 for d, v in kept.items()},
                0.01,
                {"keep": 0.0, "selective": 0.003, "full": 0.01, "offload": 0.015},
            )
        )
    profile = ModelProfile(blocks, 10**6, 4 * 10**5, 6 * 10**5, 500, 300, 100, 3000, 10**6)
    low = forecast(profile, ["offload"] * n_blocks)["peak"]
    high = forecast(profile, ["keep"] * n_blocks)["peak"]
    budget = int((low + high) / 2)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert solve(profile, budget) is not None
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, hidden=512, heads=8, vocab=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    shape = shape_from(args)
    log = progress_log()

    lines = [
        "# The planner on the CPU: forecasts and planned steps",
        "",
        command("planner.py"),
        "",
        f"Shape {shape}; fp32, AdamW, torch {torch.__version__}, {torch.get_num_threads()} threads. Peak: "
        "MemoryMeter over a full training step (optimizer state included). Step time: median of "
        f"{args.repeats} interleaved repeats after {args.warmup} warm-up steps. Overhead is against the "
        "keep-all row of the same model.",
        "",
    ]
    for name, build, data in (("HF BERT-MLM", bert_mlm, mlm_batch), ("HF GPT-2", gpt2_lm, lm_batch)):
        lines += bench_model(name, build(shape), data(shape), args.warmup, args.repeats, log)
    lines += [f"Solver: {solver_time() * 1e3:.1f} ms (median of 5) for a 200-block chain.", ""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
