"""Activation checkpointing on an HF BERT-MLM, on the CPU: memfit against the alternatives.

One run, one process. Every strategy trains its own copy of the same randomly initialised
BertForMaskedLM (fp32, AdamW) on the same batch. Step time: median of interleaved repeats
after warm-up. Memory (memfit.MemoryMeter, live tensor bytes): the peak of one full step with
its breakdown, and the activations kept after the forward.

    .venv/bin/python benchmarks/checkpointing.py [--layers 6 --hidden 768 --seq 128 --batch 8]
        [--out benchmarks/results/checkpointing_cpu.md]
"""

from __future__ import annotations

import argparse
import copy
import functools
import tempfile
import warnings

import torch
from _common import MIB, add_shape_args, command, emit, progress_log, run, shape_from, table, with_kept

import memfit
from memfit.models import Shape, bert_layer_class, bert_mlm, mlm_batch

STRATEGIES = (
    "none",
    "memfit full",
    "memfit selective (linear)",
    "memfit selective (matmul)",
    "memfit full + offload=disk",
    "torch.utils.checkpoint",
    "torch checkpoint_wrapper",
    "fairscale checkpoint_wrapper",
)


def prepare(strategy: str, base: torch.nn.Module, offload_dir: str | None = None) -> torch.nn.Module:
    """A deep copy of ``base`` with ``strategy`` applied to every BertLayer."""
    model = copy.deepcopy(base)
    layer = bert_layer_class()
    memfit_decisions = {
        "memfit full": memfit.Decision("full"),
        "memfit selective (linear)": memfit.Decision("selective", save="linear"),
        "memfit selective (matmul)": memfit.Decision("selective", save="matmul"),
        "memfit full + offload=disk": memfit.Decision(
            "offload", offload=memfit.Offload("disk", directory=offload_dir or tempfile.gettempdir())
        ),
    }
    if strategy in memfit_decisions:
        memfit_decisions[strategy].apply_to(model, layer)
    elif strategy == "torch.utils.checkpoint":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif strategy == "torch checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layer),
        )
    elif strategy == "fairscale checkpoint_wrapper":
        from fairscale.nn.checkpoint import checkpoint_wrapper

        layers = model.bert.encoder.layer
        for i, blk in enumerate(layers):
            layers[i] = checkpoint_wrapper(blk)
    elif strategy != "none":
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    model.train()
    return model


def kept_minimum(shape: Shape) -> list[tuple[str, int]]:
    """Activation bytes that full per-layer checkpointing must keep after the forward.

    With every BertLayer checkpointed, what stays for backward is each layer's input, plus
    what the unchecked embeddings and MLM head save (fp32 = 4 bytes, int64 = 8 bytes).
    """
    b, s, h, v, L = shape.batch, shape.seq, shape.hidden, shape.vocab, shape.layers  # noqa: N806
    act = b * s * h * 4
    return [
        (f"L x block input = {L} x b*s*h*4", L * act),
        ("embeddings: LayerNorm input + dropout mask = 2 x b*s*h*4", 2 * act),
        ("MLM head: dense input, GELU input, LayerNorm input, decoder input = 4 x b*s*h*4", 4 * act),
        ("logits + log-softmax output = 2 x b*s*V*4", 2 * b * s * v * 4),
        ("LayerNorm mean/rstd (embeddings, head) = 4 x b*s*4", 4 * b * s * 4),
        ("input ids + labels (int64) = 2 x b*s*8", 2 * b * s * 8),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--out", help="also write the report (markdown) here")
    args = p.parse_args()
    shape = shape_from(args)
    strategies = ["none", *[s for s in args.strategies if s != "none"]]
    batch = mlm_batch(shape)
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as offload_dir:
        base = bert_mlm(shape)
        models = {s: prepare(s, base, offload_dir) for s in strategies}
        results = with_kept(run(models, batch, args.warmup, args.repeats, progress=progress_log()), models, batch)
    by_name = {r.name: r for r in results}

    lines = [
        "# Activation checkpointing on the CPU: HF BERT-MLM",
        "",
        command("checkpointing.py"),
        "",
        f"Model: BertForMaskedLM, random init, {shape}; fp32, AdamW, dropout 0.1, sdpa attention.",
        f"Machine: {torch.get_num_threads()} CPU threads, torch {torch.__version__}. Step time: median of "
        f"{args.repeats} interleaved repeats after {args.warmup} warm-up steps. Memory: MemoryMeter (live tensor "
        "bytes, each storage once).",
        "",
        table(results),
        "",
    ]
    terms = kept_minimum(shape)
    minimum = sum(v for _, v in terms)
    lines += ["## Kept activations of full checkpointing against the arithmetic minimum", ""]
    lines += [f"- {name}: {v / MIB:.2f} MiB" for name, v in terms]
    lines.append(f"- **minimum: {minimum / MIB:.2f} MiB**")
    lines.append("")
    for name in ("memfit full", "torch.utils.checkpoint", "torch checkpoint_wrapper", "fairscale checkpoint_wrapper"):
        if name in by_name:
            kept = by_name[name].kept
            lines.append(f"- {name}: kept {kept / MIB:.2f} MiB = {kept / minimum:.3f}x the minimum")
    lines.append("")
    lines += ["## Targets (issue: checkpointing that beats torch's)", ""]
    none, full, ref = by_name["none"], by_name.get("memfit full"), by_name.get("torch.utils.checkpoint")
    if full and ref:
        lines.append(
            f"- memfit full: peak {full.peak / MIB:.1f} MiB vs torch's {ref.peak / MIB:.1f} MiB (target <=); "
            f"step time {full.time / ref.time:.3f}x torch's (target <= 1.02x); kept activations "
            f"{full.kept / minimum:.3f}x the minimum (target within 10%)"
        )
    for name in ("memfit selective (linear)", "memfit selective (matmul)"):
        if name in by_name:
            r = by_name[name]
            lines.append(
                f"- {name}: saves {1 - r.kept / none.kept:.1%} of the kept activation bytes of none "
                f"({1 - r.breakdown['activations_and_other'] / none.breakdown['activations_and_other']:.1%} "
                f"of activations at the peak; target >= 30%) at {r.time / none.time:.3f}x the time of none "
                "(target <= 1.10x)"
            )
    lines.append("")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
