"""The measurement loop of `memfit bench`, one process or many: interleaved timing, then memory.

Each strategy gets its own model copy and AdamW. After warm-up, the timed repeats go
round-robin over the strategies (so drift in machine load hits all of them alike) and the
median is reported. Memory is measured afterwards with MemoryMeter, which slows every op, so
it never runs during a timed step: one full step per strategy gives the peak and its
breakdown. On many ranks every rank runs the same loop on its own batch; each timed step is
between barriers (so it includes waiting for the slowest rank) and the peak is the maximum
over ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import memfit


@dataclass
class Result:
    """One strategy's measurements (on many ranks: this rank's, except ``peak``)."""

    name: str
    times: list[float] = field(default_factory=list)  # seconds of each timed step
    first_loss: float = float("nan")  # the loss of the first warm-up step
    peak: int = 0  # peak bytes of one step (on many ranks: the maximum over ranks)
    breakdown: dict[str, int] = field(default_factory=dict)  # MemoryMeter.breakdown() at that peak

    @property
    def time(self) -> float:
        """The median step time."""
        return statistics.median(self.times)


def make_step(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer) -> Callable[[int], float]:
    """One training step (forward, backward, optimizer) with the RNG seeded; returns the loss."""

    def step(seed: int) -> float:
        torch.manual_seed(seed)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def run(
    models: dict[str, torch.nn.Module],
    batch: dict,
    warmup: int,
    repeats: int,
    progress: Callable[[str], object] = print,
    *,
    across_ranks: bool = False,
) -> list[Result]:
    """Warm up, time and measure the peak of each model, in the order of ``models``.

    ``across_ranks``: every rank of the default process group calls this with the same
    strategies (collectives inside the models meet); timed steps run between barriers and
    each result's ``peak`` is the maximum over ranks.
    """
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    steps = {n: make_step(m, batch, opts[n]) for n, m in models.items()}
    results = {n: Result(n) for n in models}
    barrier = dist.barrier if across_ranks else lambda: None
    for n, step in steps.items():
        progress(f"warm-up: {n}")
        results[n].first_loss = step(0)
        for i in range(1, warmup):
            step(i)
    for r in range(repeats):
        progress(f"timed round {r + 1}/{repeats}")
        for n, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            step(100 + r)
            barrier()
            results[n].times.append(time.perf_counter() - t0)
    for n, step in steps.items():
        progress(f"memory: {n}")
        with memfit.MemoryMeter(model=models[n], optimizer=opts[n]) as meter:
            step(1000)
        results[n].peak = meter.peak_bytes
        results[n].breakdown = meter.breakdown()
    if across_ranks:
        peaks: list[dict[str, int]] = [{}] * dist.get_world_size()
        dist.all_gather_object(peaks, {n: r.peak for n, r in results.items()})
        for n, result in results.items():
            result.peak = max(p[n] for p in peaks)
    return list(results.values())
