"""What `memfit train` reports as it goes: console lines (rank 0), a JSONL metrics file written
line by line (flushed, so a killed run keeps what it logged), and TensorBoard scalars when the
``tensorboard`` package is installed (optional; without it --tensorboard warns and goes on)."""

from __future__ import annotations

import json
import os
import time
import warnings

MIB = 2**20


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


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
        """A step's line: loss, lr, norm, throughput, the slowest rank's step time, ETA and,
        on the step measured, the peak memory (per rank: the highest and lowest)."""
        self.say(
            f"step {e['step']}/{steps} | loss {e['loss']:.4f} | lr {e['lr']:.2e} | grad norm {e['grad_norm']:.3f} | "
            f"{e['tokens_per_s']:.0f} tok/s | {e['step_s_slowest']:.3f} s/step | ETA {duration(eta)}"
            f"{_peaks(e.get('peak_bytes_per_rank'))}"
        )

    def summary(self, steps: int, tokens: int, seconds: float, saved: list[str]) -> None:
        """The run's last line: what it did."""
        last = f" (the last: {saved[-1]})" if saved else ""
        self.say(
            f"trained {plural(steps, 'step')}, {plural(tokens, 'token')} in {duration(seconds)}; "
            f"{plural(len(saved), 'checkpoint')} written{last}"
        )

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.tb:
            self.tb.close()


def _peaks(per_rank: list[int] | None) -> str:
    if not per_rank:
        return ""
    if len(per_rank) == 1:
        return f" | peak {per_rank[0] / MIB:.1f} MiB"
    hi = max(range(len(per_rank)), key=lambda r: per_rank[r])
    return f" | peak {min(per_rank) / MIB:.1f}-{per_rank[hi] / MIB:.1f} MiB per rank (highest: rank {hi})"
