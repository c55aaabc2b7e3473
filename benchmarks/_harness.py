"""Shared measurement loop for the benchmark scripts: interleaved timing, then memory.

Each strategy gets its own model copy and optimizer. After warm-up, the timed repeats go
round-robin over the strategies (so drift in machine load hits all of them alike); the
median is reported. Memory is measured afterwards, one step per strategy, with MemoryMeter
(timing runs never run under the meter, which slows every op).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import memfit


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)
    first_loss: float = float("nan")
    peak: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def time(self) -> float:
        return statistics.median(self.times)


def make_step(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer) -> Callable[[int], float]:
    def step(seed: int) -> float:
        torch.manual_seed(seed)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def run(models: dict[str, torch.nn.Module], batch: dict, warmup: int, repeats: int) -> list[Result]:
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    steps = {n: make_step(m, batch, opts[n]) for n, m in models.items()}
    results = {n: Result(n) for n in models}
    for n, step in steps.items():
        results[n].first_loss = step(0)
        for i in range(1, warmup):
            step(i)
    for r in range(repeats):
        for n, step in steps.items():
            t0 = time.perf_counter()
            step(100 + r)
            results[n].times.append(time.perf_counter() - t0)
    for n, step in steps.items():
        with memfit.MemoryMeter(model=models[n], optimizer=opts[n]) as meter:
            step(1000)
        results[n].peak = meter.peak_bytes
        results[n].breakdown = meter.breakdown()
    return list(results.values())


def table(results: list[Result]) -> str:
    base = results[0]
    mib = 2**20
    lines = [
        "| strategy | peak MiB | activations+other MiB | step s (median) | time vs none | peak vs none | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.peak / mib:.1f} | {r.breakdown['activations_and_other'] / mib:.1f} | "
            f"{r.time:.3f} | {r.time / base.time:.2f}x | {r.peak / base.peak:.2f}x | {r.first_loss:.6f} |"
        )
    return "\n".join(lines)
