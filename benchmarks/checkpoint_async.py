"""What a checkpoint save costs the training loop: synchronous vs asynchronous (async_=True).

One process (a group of one), a preset model sharded per layer, AdamW. Each run trains
``--steps`` steps and saves a checkpoint after step 2; a run without a save is the baseline.
Reported per mode, medians over ``--repeats`` runs (the runs alternate modes):

- in the call: the time ``save_checkpoint`` holds the training loop (sync: the whole write;
  async: the copy to host memory);
- extra wall time: the run's time minus the baseline run's (async: the background write
  competes with training for the same cores, which a GPU job's host does not, as the steps
  run on the GPU; on this 2-core machine it shows up here);

    .venv/bin/python benchmarks/checkpoint_async.py [--model gpt2-small] [--steps 8] [--repeats 3] [--out F.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from _common import emit

import memfit
from memfit.models import PRESETS, lm_batch
from memfit.testing import init_process_group

SAVE_AFTER = 2


def run(model, opt, batch, steps: int, mode: str, path: str) -> tuple[float, float]:
    """(seconds in the save call, seconds of the whole run with the save's write waited for)."""
    in_call = 0.0
    future = None
    t0 = time.perf_counter()
    for step in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == SAVE_AFTER and mode != "none":
            s = time.perf_counter()
            future = memfit.save_checkpoint(path, model, opt, extra={"step": step}, async_=mode == "async")
            in_call = time.perf_counter() - s
    if future is not None:
        future.result()
    return in_call, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    init_process_group()
    torch.manual_seed(0)
    preset = PRESETS[args.model]
    model = memfit.FullyShardedDataParallel(preset.build(), auto_wrap_policy={preset.layer_class()})
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch(preset.resized(seq=64, batch=1).shape)
    modes = ("none", "sync", "async")
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    root = tempfile.mkdtemp()
    size = 0
    try:
        for r in range(args.repeats + 1):  # the first round warms up
            for mode in modes:
                path = os.path.join(root, f"ck-{r}-{mode}")
                result = run(model, opt, batch, args.steps, mode, path)
                if mode != "none":
                    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                    shutil.rmtree(path)
                if r:
                    times[mode].append(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(t for _, t in times["none"])
    lines = [
        f"# Checkpoint save stall: synchronous vs asynchronous (CPU, {args.model}, {size / 2**20:.0f} MiB "
        f"on disk, {args.steps} steps, median of {args.repeats})",
        "",
        f"Command: `.venv/bin/python benchmarks/checkpoint_async.py --model {args.model} --steps {args.steps} "
        f"--repeats {args.repeats}`",
        "",
        f"Baseline: {args.steps} steps without a save took {base:.2f} s.",
        "",
        "| save | in the call s | extra wall time s |",
        "|---|---:|---:|",
    ]
    for mode in ("sync", "async"):
        in_call = statistics.median(c for c, _ in times[mode])
        extra = statistics.median(t for _, t in times[mode]) - base
        lines.append(f"| {mode} | {in_call:.3f} | {extra:.2f} |")
    emit([*lines, ""], args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
