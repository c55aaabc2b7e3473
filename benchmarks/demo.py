"""`make demo`: train a small HF BERT-MLM with and without activation checkpointing.

One run, one process, on the CPU. Strategies: none; memfit.checkpoint on every BertLayer;
torch.utils.checkpoint (non-reentrant) via HF's gradient_checkpointing_enable. Step time is
the median of interleaved repeats after warm-up; peak is the live tensor bytes of one step
(memfit.MemoryMeter), with the AdamW state and gradients included.

    .venv/bin/python benchmarks/demo.py [--layers 4 --hidden 256 --seq 128 --batch 8]
"""

from __future__ import annotations

import argparse

import torch
from strategies import prepare

from memfit.cli._measure import run, table
from memfit.models import BertShape, bert_mlm, mlm_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    shape = BertShape(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch)
    base = bert_mlm(shape)
    models = {s: prepare(s, base) for s in ("none", "memfit full", "torch.utils.checkpoint")}
    print(f"HF BertForMaskedLM {shape}\nAdamW, fp32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"step time: median of {args.repeats} interleaved repeats after {args.warmup} warm-up steps\n")
    print(table(run(models, mlm_batch(shape), args.warmup, args.repeats, progress=lambda s: None)))


if __name__ == "__main__":
    main()
