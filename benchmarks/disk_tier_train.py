"""`memfit train` with the model state on the disk tier: a GPT whose fp32 parameters,
gradients and AdamW state (16 bytes a parameter) are ``--state`` times this machine's RAM,
trained ``--steps`` steps on one rank with every block's state on disk (issue 50's "done when":
state >= 1.5x RAM, resident memory never above half of it, step time within 2x of the disk's
bytes over its measured bandwidth plus the priced compute).

    nice -n 10 .venv/bin/python benchmarks/disk_tier_train.py --state 1.5 --dir /tmp/memfit-disk \
        --out benchmarks/results/disk_tier_train.md

What it does, in order:
- the disk's own rates under ``--dir``: ``dd`` with direct I/O (write, then read);
- the CPU's priced compute: the fp32 GEMM rate of the model's own matmul shape and the fused
  AdamW rate (memfit.host_optimizer's step), both measured here; a step's compute is
  6 x parameters x tokens FLOPs (forward 2, backward 4: the 1TB --budget keeps every
  activation, tiny at this batch) at that rate, plus the AdamW step over every parameter;
- a GPT-2 config.json (hidden ``--hidden``, heads of 128, ``--vocab`` tokens) with as many blocks
  as make the state ``--state`` x RAM, and ``memfit train`` on it in a child process with
  ``--budget 1TB --host-budget 1GB --disk DIR`` (so the planner puts every block on disk),
  batch 1 x ``--seq`` tokens (the compute stays small);
- while it runs, every 0.2 s: the child's VmRSS and VmHWM (/proc/PID/status) and its storage
  reads and writes (/proc/PID/io), cut at each step by the --metrics lines it writes;
- the report: per step its time, the bytes it moved, their time at the dd rates, the priced
  compute, the bound (2x their sum) and the peak resident memory against half of RAM.
The scratch directory is removed at the end (the tier's files are unlinked already).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import torch
from _common import emit
from offload_tiers import dd_bandwidth

HEAD = 128  # hidden per attention head


def ram_bytes() -> int:
    return int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) * 1024


def params_of(hidden: int, layers: int, vocab: int, positions: int) -> int:
    """GPT-2's parameter count: per block 12 h^2 + 13 h, embeddings (tied head), final norm."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + positions) * hidden + 2 * hidden


def gemm_rate(hidden: int, tokens: int, repeats: int = 5) -> float:
    """FLOP/s of the model's MLP matmul shape on this CPU, fp32 (median of ``repeats``)."""
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        times.append((time.perf_counter() - t0) / 4)
    return 2 * tokens * hidden * 4 * hidden / sorted(times[1:])[len(times[1:]) // 2]


def adamw_seconds_per_param(n: int = 20_000_000) -> float:
    """The fused AdamW step's seconds per parameter on this CPU (median of 3, after one)."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1] / n


def proc(pid: int) -> tuple[int, int, int, int]:
    """(VmRSS, VmHWM, storage read bytes, storage written bytes) of process ``pid``."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    io = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines())
    kib = lambda k: int(status[k].split()[0]) * 1024  # noqa: E731
    return kib("VmRSS"), kib("VmHWM"), int(io["read_bytes"]), int(io["write_bytes"])


def run_train(args, config: str, metrics: str, out_json: str, bandwidth: float) -> dict:
    """``memfit train`` in a child; the samples of its memory and I/O, cut at each step."""
    disk = os.path.join(args.dir, "tier")
    os.makedirs(disk, exist_ok=True)
    cmd = [
        sys.executable, "-m", "memfit", "train", "--model", config, "--seq", str(args.seq), "--batch", "1",
        "--steps", str(args.steps), "--warmup", "0", "--device", "cpu",
        "--budget", "1TB", "--host-budget", args.host_budget, "--disk", disk,
        "--disk-bandwidth", str(int(bandwidth)), "--metrics", metrics, "--json", out_json, "--log-every", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, cuts, peak_rss, hwm = [], [], 0, 0
    while child.poll() is None:
        try:
            rss, hwm_now, read, wrote = proc(child.pid)
        except (FileNotFoundError, ProcessLookupError, ValueError, KeyError):
            break
        now = time.perf_counter() - t0
        peak_rss, hwm = max(peak_rss, rss), max(hwm, hwm_now)
        samples.append((now, rss, read, wrote))
        lines = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
        while len(cuts) < lines:
            cuts.append((now, read, wrote, hwm_now))
        time.sleep(0.2)
    output = child.communicate()[0]
    if child.returncode != 0:
        raise SystemExit(f"memfit train failed ({child.returncode}):\n{output[-4000:]}")
    return {"samples": samples, "cuts": cuts, "peak_rss": peak_rss, "hwm": hwm, "output": output,
            "wall": time.perf_counter() - t0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", type=float, default=1.5, help="model state (16 B/param) over RAM")
    ap.add_argument("--dir", default="/tmp/memfit-disk-bench", help="scratch directory on the disk")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-budget", default="1GB", help="host memory for the state off disk")
    ap.add_argument("--dd-mib", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ram = ram_bytes()
    positions = 1024
    per_block = params_of(args.hidden, 1, 0, 0)
    rest = params_of(args.hidden, 0, args.vocab, positions)
    layers = max(1, -(-int(args.state * ram / 16 - rest) // per_block))
    n = params_of(args.hidden, layers, args.vocab, positions)
    os.makedirs(args.dir, exist_ok=True)
    config = os.path.join(args.dir, "config.json")
    with open(config, "w") as f:
        json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": args.hidden,
                   "n_head": args.hidden // HEAD, "n_layer": layers, "vocab_size": args.vocab,
                   "n_positions": positions, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, f)  # fmt: skip
    try:
        write_bw, read_bw = dd_bandwidth(args.dir, args.dd_mib)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rate, adam = gemm_rate(args.hidden, args.seq), adamw_seconds_per_param()
        metrics, out_json = os.path.join(args.dir, "metrics.jsonl"), os.path.join(args.dir, "train.json")
        for stale in (metrics, out_json):
            if os.path.exists(stale):
                os.unlink(stale)
        got = run_train(args, config, metrics, out_json, min(read_bw, write_bw))
        log = [json.loads(line) for line in open(metrics)]
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    emit(report(args, ram, n, layers, write_bw, read_bw, rate, adam, got, log), args.out)


def report(args, ram, n, layers, write_bw, read_bw, rate, adam, got, log) -> list[str]:
    compute = 6 * n * args.seq / rate + adam * n
    cuts = got["cuts"]
    lines = [
        "# `memfit train` with the model state on the disk tier",
        "",
        f"Command: `nice -n 10 .venv/bin/python benchmarks/disk_tier_train.py --state {args.state} "
        f"--dir {args.dir}` (one rank, CPU, {os.cpu_count()} cores shared with other work).",
        "",
        f"- RAM {ram / 2**30:.2f} GiB; half of it {ram / 2**31:.2f} GiB.",
        f"- Model: GPT-2, hidden {args.hidden}, {layers} blocks, vocab {args.vocab}: {n / 1e9:.3f}B parameters; "
        f"fp32 parameters + gradients + AdamW state = {16 * n / 2**30:.1f} GiB = {16 * n / ram:.2f}x RAM.",
        f"- Disk ({args.dir}), dd direct I/O {args.dd_mib} MiB: write {write_bw / 1e9:.2f} GB/s, "
        f"read {read_bw / 1e9:.2f} GB/s.",
        f"- Priced compute a step: 6 x {n / 1e9:.2f}B x {args.seq} tokens at {rate / 1e9:.1f} GFLOP/s "
        f"(measured GEMM) + fused AdamW {adam * n:.1f} s ({adam * 1e9:.2f} ns/param measured) = {compute:.1f} s.",
        f"- Peak resident memory of the run (VmHWM, sampled every 0.2 s): {got['hwm'] / 2**30:.2f} GiB "
        f"({got['hwm'] / ram:.1%} of RAM); at the end of step {len(cuts)}: "
        f"{(cuts[-1][3] if cuts else 0) / 2**30:.2f} GiB (the build and the steps; the rest is the end of the run); "
        f"wall time {got['wall']:.0f} s including the model's build.",
        "",
        "| step | step s | read GB | written GB | disk s at dd rates | priced compute s | 2x (disk + compute) s "
        "| within |",
        "|---:|---:|---:|---:|---:|---:|---:|:--|",
    ]  # fmt: skip
    for i, entry in enumerate(log):
        step_s = entry["step_s_slowest"]
        if i == 0 or i >= len(cuts):  # (the first step's bytes are not separable from the build's)
            lines.append(f"| {entry['step']} | {step_s:.1f} | (with the build) | | | | | |")
            continue
        read, wrote = cuts[i][1] - cuts[i - 1][1], cuts[i][2] - cuts[i - 1][2]
        disk_s = read / read_bw + wrote / write_bw
        bound = 2 * (disk_s + compute)
        lines.append(
            f"| {entry['step']} | {step_s:.1f} | {read / 1e9:.1f} | {wrote / 1e9:.1f} | {disk_s:.1f} | {compute:.1f} | "
            f"{bound:.1f} | {'yes' if step_s <= bound else 'NO'} |"
        )
    lines += [
        "",
        "Bytes per step are the child's storage reads and writes (/proc/PID/io) between the metrics lines "
        "of consecutive steps (so they include the few ms of logging between steps); the first step's are "
        "not separable from the build's (the model is built in host memory, then its shards move to disk).",
        "",
        "memfit train's own lines:",
        "",
        "```",
        *[line for line in got["output"].splitlines() if line.startswith("memfit train")][-8:],
        "```",
    ]
    return lines


if __name__ == "__main__":
    main()
