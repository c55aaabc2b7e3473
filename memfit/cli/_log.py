"""What `memfit train` reports as it goes: console lines (rank 0), a JSONL metrics file written
line by line (flushed, so a killed run keeps what it logged), and TensorBoard scalars when the
``tensorboard`` package is installed (optional; without it --tensorboard warns and goes on)."""

from __future__ import annotations

import json
import os
import time
import warnings

MIB = 2**20


def duration(seconds: float) -> str:
    """``seconds`` as 1h02m, 3m05s or 12s."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RunLog:
    """Console, JSONL and TensorBoard output of one run; every method is a no-op off rank 0."""

    def __init__(self, rank: int, metrics: str | None, tensorboard: str | None) -> None:
        self.active = rank == 0
        self.metrics = None
        self.tb = None
        self.t0 = time.perf_counter()
        if not self.active:
            return
        if metrics:
            os.makedirs(os.path.dirname(os.path.abspath(metrics)), exist_ok=True)
            self.metrics = open(metrics, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(tensorboard)
            except ImportError:
                warnings.warn(
                    "memfit train: --tensorboard needs the tensorboard package (pip install tensorboard); "
                    "logging to the console and --metrics only",
                    stacklevel=2,
                )

    def say(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def record(self, entry: dict) -> None:
        """Write one entry (a step's or an evaluation's metrics) to the JSONL file and TensorBoard."""
        if not self.active:
            return
        if self.metrics:
            self.metrics.write(json.dumps(entry) + "\n")
            self.metrics.flush()
        if self.tb:
            for k, v in entry.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, entry["step"])

    def step_line(self, e: dict, steps: int, eta: float) -> None:
        peak = f" | peak {e['peak_bytes'] / MIB:.1f} MiB" if "peak_bytes" in e else ""
        self.say(
            f"step {e['step']}/{steps} | loss {e['loss']:.4f} | lr {e['lr']:.2e} | grad norm {e['grad_norm']:.3f} | "
            f"{e['tokens_per_s']:.0f} tok/s | ETA {duration(eta)}{peak}"
        )

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.tb:
            self.tb.close()
