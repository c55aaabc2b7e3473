"""Host (Python) cost of activation checkpointing per layer: memfit against torch.utils.checkpoint.

A BertForMaskedLM so small that its compute is negligible (24 layers, hidden 32, seq 16,
batch 2 by default), so a forward + backward's wall time is the CPU work that launches it: on
an accelerator that work is what the device waits for once the step is fast (bf16). Every
strategy checkpoints every BertLayer of its own copy of the same model; the steps are
interleaved (one of each strategy per round) after warm-up, and the median is reported.
"host us / layer vs torch" is (median - torch.utils.checkpoint's median) / layers: the
per-layer cost memfit adds over torch's checkpoint, measured in the same process.

    .venv/bin/python benchmarks/checkpoint_overhead.py [--layers 24 --repeats 200 --warmup 20]
        [--dtype fp32 bf16] [--out benchmarks/results/checkpoint_overhead_cpu.md]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
import warnings

import torch
from _common import command, emit

import memfit
from memfit.models import Shape, bert_layer_class, bert_mlm, mlm_batch

STRATEGIES = (
    "none",
    "torch.utils.checkpoint",
    "torch selective (matmul)",
    "memfit full",
    "memfit selective (matmul)",
    "memfit offload (cpu)",
)


def _torch_sac_matmul():
    """torch's own selective activation checkpoint (create_selective_checkpoint_contexts) with
    memfit's "matmul" rule, under torch.utils.checkpoint: the reference for selective."""
    from memfit._checkpoint._selective import selective_context_fn

    return selective_context_fn("matmul")


def prepare(strategy: str, base: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    model = copy.deepcopy(base).to(device).train()
    layer = bert_layer_class()
    if strategy == "memfit full":
        memfit.Decision("full").apply_to(model, layer)
    elif strategy == "memfit selective (matmul)":
        memfit.Decision("selective", save="matmul").apply_to(model, layer)
    elif strategy == "memfit offload (cpu)":
        memfit.Decision("offload", offload="cpu").apply_to(model, layer)
    elif strategy in ("torch.utils.checkpoint", "torch selective (matmul)"):
        kwargs: dict = {"use_reentrant": False}
        if strategy == "torch selective (matmul)":
            kwargs["context_fn"] = _torch_sac_matmul()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def step_fn(model: torch.nn.Module, batch: dict, dtype: str):
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def step() -> float:
        sync()
        t0 = time.perf_counter_ns()
        with amp:
            loss = model(**batch).loss
        loss.backward()
        sync()
        elapsed = time.perf_counter_ns() - t0
        for p in model.parameters():
            p.grad = None
        return elapsed / 1e9

    return step


def measure(shape: Shape, dtype: str, warmup: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    base = bert_mlm(shape)
    batch = {k: v.to(device) for k, v in mlm_batch(shape).items()}
    steps = {s: step_fn(prepare(s, base, device), batch, dtype) for s in STRATEGIES}
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for _ in range(repeats):
        for s, step in steps.items():  # interleaved: drift hits every strategy alike
            times[s].append(step())
    return {s: statistics.median(ts) for s, ts in times.items()}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (wall time, synchronized per step)"
    return "the CPU"


def report(shape: Shape, results: dict[str, dict[str, float]], args) -> list[str]:
    lines = [
        f"# Checkpointing host overhead per layer ({shape.layers} BertLayers, {args.device})",
        "",
        command("checkpoint_overhead.py"),
        "",
        f"BertForMaskedLM {shape}, every BertLayer checkpointed; forward + backward (no optimizer), on "
        f"{_device_name(args.device)}. torch {torch.__version__}, {torch.get_num_threads()} threads. "
        f"Median of {args.repeats} interleaved steps after {args.warmup} warm-up rounds. At the default size "
        "compute is negligible: the step time is the host work that launches it. memfit imported from "
        f"`{os.path.dirname(memfit.__file__)}`.",
        "",
        "| dtype | strategy | step ms (median) | vs none | vs torch.utils.checkpoint | host us / layer vs none "
        "| host us / layer vs torch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, r in results.items():
        none, torch_ckpt = r["none"], r["torch.utils.checkpoint"]
        for s, t in r.items():
            lines.append(
                f"| {dtype} | {s} | {t * 1e3:.2f} | {t / none:.2f}x | {t / torch_ckpt:.2f}x "
                f"| {(t - none) / shape.layers * 1e6:.0f} | {(t - torch_ckpt) / shape.layers * 1e6:+.0f} |"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: less noise)")
    p.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (on cuda: wall time with a synchronize per step)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = Shape(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, vocab=args.vocab
    )
    results = {d: measure(shape, d, args.warmup, args.repeats, args.device) for d in args.dtype}
    emit(report(shape, results, args), args.out)


if __name__ == "__main__":
    main()
