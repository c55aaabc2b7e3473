"""The optimizer step over host shards: torch's CPU default against memfit.host_optimizer.

One process (a gloo group of one), a stack of ``--blocks`` Linear(h, h) + Tanh layers sharded
per Linear with ``offload="cpu"`` (about 50M parameters by default), one backward to give every
shard a gradient. Reported, medians over ``--repeats`` after ``--warmup`` untimed runs, each
ratio against torch's default measured in the same run:

- the step: ``optimizer.step()`` alone over the host shards, with AdamW as torch builds it on
  the CPU (the for-loop), with ``foreach=True``, and under ``memfit.host_optimizer`` (torch's
  fused CPU kernels; ``overlap=False`` so that the whole step runs in the timed call);
- backward + step: one training step's backward and step, torch's default against
  ``memfit.host_optimizer`` with its per-unit steps overlapping the rest of backward.

    .venv/bin/python benchmarks/offload_tiers.py [--blocks 12] [--hidden 2048] [--repeats 5] [--out F.md]

With ``--disk DIR``, also a step with the state on disk there: its time, the bytes it read and wrote
(/proc/self/io) and those bytes over the rates ``dd`` measures on that disk. The GPU comparison
with FSDP2's CPUOffloadPolicy is not written yet (issue 50).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from _common import emit
from torch import nn

import memfit
from memfit.testing import init_process_group


def build(blocks: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(hidden, hidden), nn.Tanh())])
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy=nn.Linear, offload="cpu")


def optimizer(model: nn.Module, kind: str, disk: str | None = None) -> torch.optim.Optimizer:
    if kind == "foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind.startswith("memfit"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (it says which implementation it runs: fused)
            where = disk if kind == "memfit-disk" else None
            opt = memfit.host_optimizer(model, opt, overlap=kind != "memfit", disk=where)
    return opt


def interleaved(args, kinds: tuple[str, ...], timed_step, disk: str | None = None) -> tuple[dict[str, float], dict]:
    """Median seconds per kind, the kinds measured in turn within each repeat (the machine's
    load changes during a run: each repeat sees the same load for every kind)."""
    runs = {}
    for kind in kinds:
        model = build(args.blocks, args.hidden)
        runs[kind] = (model, optimizer(model, kind, disk))
    x = torch.randn(args.batch, args.hidden)
    for model, _ in runs.values() if timed_step is step_alone else ():
        model(x).square().mean().backward()  # every shard has a gradient, which the steps reuse
    spent: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(args.warmup + args.repeats):
        for kind in kinds:
            seconds = timed_step(*runs[kind], x)
            if r >= args.warmup:
                spent[kind].append(seconds)
    host = {k: o._memfit_host_step.steps_in_backward for k, (_, o) in runs.items() if hasattr(o, "_memfit_host_step")}
    return {kind: statistics.median(v) for kind, v in spent.items()}, host


def step_alone(model, opt, x) -> float:
    """``optimizer.step()`` alone, on the gradients already there."""
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def backward_and_step(model, opt, x) -> float:
    """A backward and the step after it (the forward untimed)."""
    opt.zero_grad()
    out = model(x).square().mean()
    t0 = time.perf_counter()
    out.backward()
    opt.step()
    return time.perf_counter() - t0


def io_bytes() -> tuple[int, int]:
    """(bytes this process read from storage, bytes it wrote), from /proc/self/io."""
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def dd_bandwidth(directory: str, mib: int) -> tuple[float, float]:
    """The disk's own sequential write and read rates (bytes/s), by dd with direct I/O."""
    path = os.path.join(directory, "dd.bin")
    rates = []
    for cmd in (
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"],
        ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        rates.append(mib * 2**20 / float(re.search(r"copied, ([0-9.]+) s", out).group(1)))  # type: ignore[union-attr]
    os.unlink(path)
    return rates[0], rates[1]


def disk_step(args) -> list[str]:
    """A training step with the host units' state on disk, against the host tier."""
    directory = tempfile.mkdtemp(dir=args.disk)
    write, read = dd_bandwidth(directory, args.dd_mib)
    moved: list[tuple[int, int]] = []

    def counted(model, opt, x) -> float:
        before = io_bytes()
        seconds = backward_and_step(model, opt, x)
        after = io_bytes()
        if hasattr(opt, "_memfit_host_step") and opt._memfit_host_step.disk is not None:
            moved.append((after[0] - before[0], after[1] - before[1]))
        return seconds

    times, _ = interleaved(args, ("memfit-overlap", "memfit-disk"), counted, directory)
    shutil.rmtree(directory)
    r, w = statistics.median(m[0] for m in moved), statistics.median(m[1] for m in moved)
    floor = r / read + w / write
    return [
        "",
        f"## A step with the state on disk (`--disk {args.disk}`)",
        "",
        f"The disk by dd (direct I/O, {args.dd_mib} MiB): write {write / 2**20:.0f} MiB/s, "
        f"read {read / 2**20:.0f} MiB/s.",
        "",
        "| backward + step | ms | read from disk per step | written per step | disk bytes / dd rate |",
        "|---|---:|---:|---:|---:|",
        f"| host tier (`host_optimizer`) | {times['memfit-overlap'] * 1e3:.1f} | | | |",
        f"| disk tier (`host_optimizer(disk=...)`) | {times['memfit-disk'] * 1e3:.1f} | {r / 2**20:.0f} MiB | "
        f"{w / 2**20:.0f} MiB | {floor * 1e3:.1f} ms |",
        "",
        "Bytes are this process's storage reads and writes during the step (/proc/self/io; the forward",
        "is untimed and uncounted), medians over the repeats.",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--disk", default=None, help="a directory on a local disk: also time the disk tier there")
    p.add_argument("--dd-mib", type=int, default=1024, help="MiB dd writes and reads to measure the disk")
    args = p.parse_args()
    init_process_group()
    params = args.blocks * (args.hidden * args.hidden + args.hidden)
    load = os.getloadavg()[0]
    steps, _ = interleaved(args, ("default", "foreach", "memfit"), step_alone)
    gc.collect()
    both, host = interleaved(args, ("default", "memfit-overlap"), backward_and_step)
    base, base2 = steps["default"], both["default"]
    cmd = "python benchmarks/offload_tiers.py " + " ".join(sys.argv[1:])
    lines = [
        f"# The optimizer step over host shards (CPU, {params / 1e6:.1f}M parameters, AdamW)",
        "",
        f"Command: `.venv/bin/{cmd.strip()}`",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load:.1f} at the start.",
        f"Medians of {args.repeats} after {args.warmup} warm-up, the kinds measured in turn within each repeat; "
        "ratios against torch's default in the same run.",
        "",
        "| the step (`optimizer.step()` alone) | ms | speed-up |",
        "|---|---:|---:|",
        f"| torch AdamW, CPU default (for-loop) | {base * 1e3:.1f} | 1.00x |",
        f"| torch AdamW, `foreach=True` | {steps['foreach'] * 1e3:.1f} | {base / steps['foreach']:.2f}x |",
        f"| `memfit.host_optimizer` (fused CPU kernels) | {steps['memfit'] * 1e3:.1f} | "
        f"{base / steps['memfit']:.2f}x |",
        "",
        "| backward + step | ms | speed-up |",
        "|---|---:|---:|",
        f"| torch AdamW, CPU default | {base2 * 1e3:.1f} | 1.00x |",
        f"| `memfit.host_optimizer`, per-unit steps in backward | {both['memfit-overlap'] * 1e3:.1f} | "
        f"{base2 / both['memfit-overlap']:.2f}x |",
        "",
        f"Unit steps that ran in backward under `memfit.host_optimizer`: {host['memfit-overlap']} "
        f"({args.blocks} units x {args.warmup + args.repeats} steps).",
    ]
    if args.disk:
        lines += disk_step(args)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
