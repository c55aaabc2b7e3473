"""memfit's forecast of torchtitan's published Llama 3 runs, on paper (the models on the meta
device, priced on the named device profiles), beside the figures torchtitan measured.

torchtitan's docs/performance.md:
- Llama 3.1 8B on 8 H100 (96 GB HBM2e, 500 W), FSDP, local batch 2 (global 16), selective
  activation checkpointing, bf16 mixed precision: 5,762 tokens/s/GPU eager (82.4 GiB),
  6,667 with torch.compile (77.0 GiB).
- Llama 3 70B on 64 A100 (80 GB), FSDP, local batch 1 (global 64), full activation
  checkpointing: 323 tokens/s/GPU (an earlier version of the page: 331).

For each, memfit.autoconfigure prices that configuration alone (its micro-batch, full sharding,
reshard_after_forward, every block the same kind, bf16 mixed precision with fp32 reduce; its
sequence length 8192) and then searches every configuration within the device's memory at the
same global batch: the pick and its predicted tokens/s/GPU. The profiles' figures are achieved
rates, host costs and NCCL bus bandwidths, each with its source ([Note: Host and device time]);
nothing here ran on a GPU.

    .venv/bin/python benchmarks/paper_torchtitan.py [--out benchmarks/results/paper_torchtitan.md]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import command, emit

import memfit
from memfit.cli._data import batch_at
from memfit.models import PRESETS

BF16 = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# (model, device profile, ranks, local batch, kind, device memory, torchtitan's tokens/s/GPU, its note)
RUNS = [
    ("llama-8b", "h100", 8, 2, "selective", "96GB", 5762, "eager; 6,667 compiled; 82.4 GiB"),
    ("llama-70b", "a100", 64, 1, "full", "80GB", 323, "331 in an earlier version"),
]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    lines = [
        "# memfit's forecast of torchtitan's Llama 3 runs (on paper)",
        "",
        command("paper_torchtitan.py"),
        "",
        "| model | GPUs | torchtitan's configuration | torchtitan measured tokens/s/GPU | memfit predicted "
        "tokens/s/GPU (same configuration) | predicted peak GiB | memfit's pick within the memory | pick "
        "predicted tokens/s/GPU | pick peak GiB | search s |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, device, world, local, kind, memory, measured, note in RUNS:
        preset = PRESETS[name]
        with torch.device("meta"):
            model = preset.build()
        seq = preset.shape.seq
        example = batch_at(preset.arch, 1, seq, step=0)
        opts = {"world_size": world, "global_batch": local * world, "device_profile": device}
        opts.update(mixed_precision=BF16, chunk_head=False)
        same = memfit.autoconfigure(
            model, example, budget="1000TB", micro_batches=[local], shard_sizes=[world], decisions=(kind,), **opts
        )
        theirs = next(c for c in same.candidates if c.layout.reshard_after_forward)
        t0 = time.perf_counter()
        pick = memfit.autoconfigure(model, example, budget=memory, **opts).best
        searched = time.perf_counter() - t0
        assert pick.plan is not None
        kinds = sorted(set(pick.plan.decisions.values()))
        lines.append(
            f"| {name} | {world} x {device} | local batch {local}, seq {seq}, FSDP, {kind} checkpointing, bf16 "
            f"| {measured:,} ({note}) | {theirs.tokens_per_second / world:,.0f} | {_gib(theirs.peak)} "
            f"| micro-batch {pick.micro_batch} x {pick.accumulation}, {pick.layout.describe()}, {'/'.join(kinds)} "
            f"| {pick.tokens_per_second / world:,.0f} | {_gib(pick.peak)} | {searched:.0f} |"
        )
    lines += [
        "",
        "torchtitan's figures: its docs/performance.md (Llama 3.1 8B: Table 1; Llama 3 70B: the A100 table). "
        "memfit prices on the profiles h100 and a100: achieved rates, host time per op and per hook, NCCL's "
        "bus bandwidth ([Note: Host and device time]; each figure's source in DeviceProfile.sources), traced "
        "in the stream CUDA runs.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
