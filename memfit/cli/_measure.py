"""The measurement loop of `memfit bench` and the benchmark scripts: interleaved timing, then memory.

Each strategy gets its own model copy and AdamW. After warm-up, the timed repeats go
round-robin over the strategies (so drift in machine load hits all of them alike) and the
median is reported. Memory is measured afterwards with MemoryMeter, which slows every op, so
it never runs during a timed step: one full step per strategy for the peak and its breakdown,
and one forward for the activations kept for backward.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import memfit
from memfit.models import Shape

MIB = 2**20


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)
    first_loss: float = float("nan")
    peak: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    kept: int = 0  # activation bytes alive after the forward (what backward will use)

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


def kept_after_forward(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of tensors other than parameters and buffers alive after one forward."""
    state = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    torch.manual_seed(0)
    with memfit.MemoryMeter(model=model) as meter:
        out = model(**batch)
    kept = meter.current_bytes - state
    del out
    return kept


def run(models: dict[str, torch.nn.Module], batch: dict, warmup: int, repeats: int, progress=print) -> list[Result]:
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    steps = {n: make_step(m, batch, opts[n]) for n, m in models.items()}
    results = {n: Result(n) for n in models}
    for n, step in steps.items():
        progress(f"warm-up: {n}")
        results[n].first_loss = step(0)
        for i in range(1, warmup):
            step(i)
    for r in range(repeats):
        progress(f"timed round {r + 1}/{repeats}")
        for n, step in steps.items():
            t0 = time.perf_counter()
            step(100 + r)
            results[n].times.append(time.perf_counter() - t0)
    for n, step in steps.items():
        progress(f"memory: {n}")
        with memfit.MemoryMeter(model=models[n], optimizer=opts[n]) as meter:
            step(1000)
        results[n].peak = meter.peak_bytes
        results[n].breakdown = meter.breakdown()
        results[n].kept = kept_after_forward(models[n], batch)
    return list(results.values())


def table(results: list[Result]) -> str:
    base = results[0]
    lines = [
        "| strategy | peak MiB | params+grads+AdamW MiB | activations+other at peak MiB | kept after forward MiB "
        "| kept vs none | step s (median) | time vs none | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        state = r.peak - r.breakdown["activations_and_other"]
        lines.append(
            f"| {r.name} | {r.peak / MIB:.1f} | {state / MIB:.1f} | {r.breakdown['activations_and_other'] / MIB:.1f} "
            f"| {r.kept / MIB:.1f} | {r.kept / base.kept:.2f}x | {r.time:.3f} | {r.time / base.time:.2f}x "
            f"| {r.first_loss:.6f} |"
        )
    return "\n".join(lines)


def add_shape_args(p: argparse.ArgumentParser, **defaults: int) -> None:
    """--layers --hidden --heads --seq --batch --vocab, with this script's defaults."""
    base = {"layers": 6, "hidden": 768, "heads": 12, "seq": 128, "batch": 8, "vocab": 30522} | defaults
    for name, value in base.items():
        p.add_argument(f"--{name}", type=int, default=value)


def shape_from(args: argparse.Namespace) -> Shape:
    return Shape(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, vocab=args.vocab
    )


def emit(lines: list[str], out: str | None) -> None:
    """Print the report, and write it to ``out`` when given."""
    report = "\n".join(lines)
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)
