"""What the benchmark scripts share: shape flags, the measurement loop of `memfit bench`, the
activations kept after a forward, the markdown table and the report.

The scripts run as ``.venv/bin/python benchmarks/<name>.py`` (this directory is on sys.path).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

import memfit
from memfit.cli._data import batch_at
from memfit.cli._measure import Result, run
from memfit.models import Shape
from memfit.testing import run_distributed, spawn

__all__ = [
    "MIB",
    "Measured",
    "Result",
    "add_shape_args",
    "batch_at",
    "command",
    "emit",
    "kept_after_forward",
    "progress_log",
    "run",
    "run_distributed",
    "shape_from",
    "spawn",
    "table",
    "with_kept",
]

MIB = 2**20


def add_shape_args(p: argparse.ArgumentParser, **defaults: int) -> None:
    """--layers --hidden --heads --seq --batch --vocab, with this script's defaults."""
    base = {"layers": 6, "hidden": 768, "heads": 12, "seq": 128, "batch": 8, "vocab": 30522} | defaults
    for name, value in base.items():
        p.add_argument(f"--{name}", type=int, default=value)


def shape_from(args: argparse.Namespace) -> Shape:
    return Shape(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, vocab=args.vocab
    )


def progress_log() -> Callable[[str], None]:
    """A progress callback for ``run``: each message on stderr with the seconds since now."""
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", file=sys.stderr)

    return log


@dataclass
class Measured(Result):
    """A result of ``run`` with the activations its model keeps after a forward."""

    kept: int = 0  # activation bytes alive after the forward (what backward will use)


def kept_after_forward(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of tensors other than parameters and buffers alive after one forward."""
    state = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    torch.manual_seed(0)
    with memfit.MemoryMeter(model=model) as meter:
        out = model(**batch)
    kept = meter.current_bytes - state
    del out
    return kept


def with_kept(results: list[Result], models: dict[str, torch.nn.Module], batch: dict) -> list[Measured]:
    """``results`` (of ``run(models, batch, ...)``) with each model's kept activations."""
    return [
        Measured(**{f.name: getattr(r, f.name) for f in fields(r)}, kept=kept_after_forward(models[r.name], batch))
        for r in results
    ]


def table(results: list[Measured]) -> str:
    """Markdown: peak, its state/activation split, kept activations and step time; ratios to the first row."""
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


def command(script: str) -> str:
    """The report's line that says how it was made."""
    return "Command: `" + " ".join([f".venv/bin/python benchmarks/{script}", *sys.argv[1:]]) + "`"


def emit(lines: list[str], out: str | None) -> None:
    """Print the report, and write it to ``out`` when given."""
    report = "\n".join(lines)
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)
