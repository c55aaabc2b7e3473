"""What the per-chunk CRC-32 of memfit checkpoints costs: save and load time with and without.

One process (a group of one), a preset model sharded per layer with AdamW state (parameters,
two moments: about 3x the parameter bytes on disk). Each repeat saves into a fresh directory
and loads it back; save and load alternate between checksums on and off, and the median of
each is reported with its ratio to the run without checksums. The page cache is warm (the
files were just written), as when a training job resumes on the machine that saved.

    .venv/bin/python benchmarks/checkpoint_checksums.py [--model gpt2-small] [--repeats 5] [--out F.md]
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
from memfit.models import PRESETS
from memfit.testing import checkpoint_checksums, init_process_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    init_process_group()
    preset = PRESETS[args.model]
    model = memfit.FullyShardedDataParallel(preset.build(), auto_wrap_policy={preset.layer_class()})
    opt = torch.optim.AdamW(model.parameters())
    for prm in model.parameters():
        prm.grad = torch.zeros_like(prm)
    opt.step()  # AdamW state exists
    times: dict[tuple[bool, str], list[float]] = {(c, w): [] for c in (False, True) for w in ("save", "load")}
    root = tempfile.mkdtemp()
    size = 0
    try:
        for r in range(args.repeats + 1):  # the first round warms up
            for checksums in (False, True):
                path = os.path.join(root, f"ck-{r}-{checksums}")
                with checkpoint_checksums(checksums):
                    t0 = time.perf_counter()
                    memfit.save_checkpoint(path, model, opt, extra={"step": 1})
                    t1 = time.perf_counter()
                    memfit.load_checkpoint(path, model, opt)
                    t2 = time.perf_counter()
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                shutil.rmtree(path)
                if r:
                    times[(checksums, "save")].append(t1 - t0)
                    times[(checksums, "load")].append(t2 - t1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"# Checkpoint checksums: cost (CPU, {args.model}, {size / 2**20:.0f} MiB on disk, median of {args.repeats})",
        "",
        f"Command: `.venv/bin/python benchmarks/checkpoint_checksums.py --model {args.model} --repeats {args.repeats}`",
        "",
        "| | without checksums s | with checksums s | ratio |",
        "|---|---|---|---|",
    ]
    for what in ("save", "load"):
        off, on = med[(False, what)], med[(True, what)]
        lines.append(f"| {what} | {off:.3f} | {on:.3f} | {on / off:.2f}x |")
    emit([*lines, ""], args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
