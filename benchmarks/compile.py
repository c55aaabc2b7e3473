"""Activation checkpointing under torch.compile (inductor, CPU): memfit against
torch.utils.checkpoint, both compiled per block, in one run.

Each strategy trains its own copy of the same randomly initialised HF GPT-2 (fp32, AdamW):
checkpointing applied to every GPT2Block, then each block compiled (torchtitan's order).
Step time: median of interleaved repeats after warm-up (the first steps compile). Memory:
the bytes the compiled graphs keep for backward (each storage once, counted by a
saved-tensor hook over one forward) — MemoryMeter cannot see inside inductor's kernels, so a
live-bytes peak is not reported here.

    .venv/bin/python benchmarks/compile.py [--layers 4 --hidden 256 --seq 128 --batch 8]
        [--out benchmarks/results/compile_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.utils.checkpoint as tuc
from _common import emit
from torch import nn

import memfit

MIB = 2**20
STRATEGIES = ("none", "torch.utils.checkpoint", "memfit full", "memfit selective (linear)")


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return tuc.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def build(args) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64,
        n_positions=max(1024, args.seq), use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def prepare(strategy: str, base: nn.Module) -> nn.Module:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = copy.deepcopy(base)
    blocks = model.transformer.h
    if strategy == "torch.utils.checkpoint":
        for i in range(len(blocks)):
            blocks[i] = _TorchCheckpointed(blocks[i])
    elif strategy == "memfit full":
        memfit.apply_activation_checkpointing(model, GPT2Block)
    elif strategy == "memfit selective (linear)":
        memfit.apply_activation_checkpointing(model, GPT2Block, save="linear")
    for block in blocks:
        block.compile()
    model.train()
    return model


def kept_bytes(model: nn.Module, batch: dict) -> int:
    """Bytes of the distinct storages saved for backward during one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    del loss
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in {"layers": 4, "hidden": 256, "seq": 128, "batch": 8, "vocab": 8192}.items():
        p.add_argument(f"--{name}", type=int, default=value)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    base = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    models = {s: prepare(s, base) for s in STRATEGIES}
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-4) for s, m in models.items()}

    def step(s: str) -> float:
        torch.manual_seed(0)
        loss = models[s](**batch).loss
        loss.backward()
        opts[s].step()
        opts[s].zero_grad(set_to_none=True)
        return loss.item()

    first = {s: step(s) for s in STRATEGIES}  # compiles
    for _ in range(args.warmup - 1):
        for s in STRATEGIES:
            step(s)
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for _ in range(args.repeats):
        for s in STRATEGIES:
            t0 = time.perf_counter()
            step(s)
            times[s].append(time.perf_counter() - t0)
    med = {s: statistics.median(v) for s, v in times.items()}
    kept = {s: kept_bytes(models[s], batch) for s in STRATEGIES}
    ref = "torch.utils.checkpoint"
    lines = [
        "# Activation checkpointing under torch.compile (inductor, CPU): HF GPT-2",
        "",
        "Command: `" + " ".join([".venv/bin/python benchmarks/compile.py", *sys.argv[1:]]) + "`",
        "",
        f"GPT2LMHeadModel, random init, layers={args.layers} hidden={args.hidden} seq={args.seq} batch={args.batch} "
        f"vocab={args.vocab}; fp32, AdamW; every block checkpointed then compiled (inductor). torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads. Step time: median of {args.repeats} interleaved "
        f"repeats after {args.warmup} warm-up steps. Kept: bytes saved for backward in one forward.",
        "",
        "| strategy | kept for backward MiB | step s (median) | time vs none | time vs torch.utils.checkpoint "
        "| first loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in STRATEGIES:
        lines.append(
            f"| {s} | {kept[s] / MIB:.1f} | {med[s]:.3f} | {med[s] / med['none']:.3f}x | {med[s] / med[ref]:.3f}x "
            f"| {first[s]:.6f} |"
        )
    emit([*lines, ""], args.out)


if __name__ == "__main__":
    main()
