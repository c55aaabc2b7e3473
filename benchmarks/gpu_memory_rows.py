"""The memory forecast made on this host for a GPU profile against the GPU's measured peak, for
every memfit row of parts b and c of a GPU validation (benchmarks/results/gpu_h100.json):

    part b  BERT-large MLM (seq 512, batch 16, dropout 0.1, AdamW), fp32 and bf16 autocast:
            none, memfit full, memfit selective (save="matmul"), memfit offload, memfit planned
    part c  BERT-large (seq 512, batch 8) and llama-1b (seq 2048, batch 1), AdamW, one rank:
            plain and memfit (FullyShardedDataParallel), fp32 and bf16 (plain: autocast;
            memfit: MixedPrecision(bf16, reduce_dtype=fp32))

Each forecast is the planner's (its profile on fake tensors, the model on the meta device,
priced for ``--device``: [Note: The target's op stream]) for the decisions the row ran; the
planned row is re-planned at its budget on this profile (its decisions and head compared with
the row's). Rows under autocast are profiled inside ``torch.autocast("cpu", bf16)``, which the
planner traces with CUDA autocast's fp32 lists for a CUDA profile. Measured: the row's
max_memory_allocated.
Goal: forecast / measured - 1 within 0 .. +3%.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_memory_rows.py [--parts b,c] [--rows fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import memfit
from memfit._plan._calibrate import device_profile
from memfit._plan._plan import Plan, _sharding
from memfit._plan._profile import DECISIONS, profile_model
from memfit.models import PRESETS, Shape, bert_mlm, lm_batch, mlm_batch

ROOT = Path(__file__).resolve().parent
MIB = 2**20
KIND = {"none": "keep", "plain": "keep", "memfit": "keep", "memfit full": "full",
        "memfit selective": "selective", "memfit offload": "offload"}  # fmt: skip


def _profile(model, batch, device: str, *, autocast: bool, mp: bool, rule: str = "linear"):
    mixed = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        prof = profile_model(model, batch, device=device_profile(device), rule=rule, mixed_precision=mixed)
    print(f"  profiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return prof


def _forecast(prof, strategy: str, row: dict, sharded: bool, model=None, batch=None, planned_on=None):
    """The forecast for the row's decisions, and a note. The planned row: memfit.plan at the
    row's budget on ``planned_on`` (the profile the row's plan was made for: fp32 compute, also
    for the autocast row) among the kinds the row's plan chose (here offload ties full in
    time, where the GPU's own profile priced it above: a re-plan among all kinds may swap
    them), its decisions and head forecast on ``prof``."""
    if strategy == "memfit planned":
        kinds = tuple(k for k in DECISIONS if k in row["decisions"])
        profile = planned_on or prof
        device = prof.device
        plan = memfit.plan(model, batch, budget=row["budget"], profile=profile, device_profile=device, decisions=kinds)
        counts = dict(Counter(plan.decisions.values()))
        same = counts == row["decisions"]
        note = f"re-planned: {counts}, head {plan.head}" + ("" if same else " (the row ran others)")
        return Plan.fixed(plan.decisions, prof, head=plan.head).predicted_peak, note
    shard = _sharding(1, None, True) if sharded else None
    return Plan.fixed(dict.fromkeys([b.path for b in prof.blocks], KIND[strategy]), prof, shard).predicted_peak, ""


def part_b(parts: dict, device: str, which: set[str]) -> list[tuple]:
    fig = parts["b"]["figures"]
    shape = Shape(**{k: v for k, v in fig["shape"].items() if k in Shape.__dataclass_fields__})
    with torch.device("meta"):
        model = bert_mlm(shape)
    batch = mlm_batch(shape)
    rows = []
    fp32 = None  # the profile the planned rows' plans were made for (the GPU planned for fp32 compute)
    for label, results in fig["results"].items():
        autocast = label != "fp32"
        if label.split()[0] not in which:
            continue
        fp32 = fp32 or _profile(model, batch, device, autocast=False, mp=False)
        prof = _profile(model, batch, device, autocast=autocast, mp=False) if autocast else fp32  # rule "linear"
        matmul = _profile(model, batch, device, autocast=autocast, mp=False, rule="matmul")  # selective's row
        for strategy, row in results.items():
            if strategy == "torch.utils.checkpoint" or "max_allocated" not in row:
                continue
            used = matmul if strategy == "memfit selective" else prof
            forecast, note = _forecast(used, strategy, row, False, model, batch, fp32)
            rows.append(("b", f"bert-large b{shape.batch} {label}", strategy, forecast, note, row["max_allocated"]))
    return rows


def part_c(parts: dict, device: str, which: set[str]) -> list[tuple]:
    rows = []
    for label, results in parts["c"]["figures"]["results"].items():
        name, dtype = label.split()
        if dtype not in which:
            continue
        preset = PRESETS[name]
        with torch.device("meta"):
            model = preset.build()
        batch = (mlm_batch if preset.arch == "bert" else lm_batch)(preset.shape)
        bf16 = dtype == "bf16"
        for strategy in ("plain", "memfit"):
            row = results.get(strategy, {})
            if "max_allocated" not in row:
                continue
            prof = _profile(
                model, batch, device, autocast=bf16 and strategy == "plain", mp=bf16 and strategy == "memfit"
            )
            forecast, note = _forecast(prof, strategy, row, sharded=strategy == "memfit")
            rows.append(("c", f"{name} b{preset.shape.batch} {dtype}", strategy, forecast, note, row["max_allocated"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "results" / "gpu_h100.json"))
    ap.add_argument("--device", default="h100")
    ap.add_argument("--parts", default="b,c")
    ap.add_argument("--rows", default="fp32,bf16", help="fp32, bf16 (bf16 autocast and mixed precision) or both")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_memory_rows.md"))
    args = ap.parse_args(argv)
    parts = json.loads(Path(args.results).read_text())["parts"]
    which = set(args.rows.split(","))
    rows = []
    if "b" in args.parts:
        rows += part_b(parts, args.device, which)
    if "c" in args.parts:
        rows += part_c(parts, args.device, which)
    command = "PYTHONPATH=. .venv/bin/python benchmarks/gpu_memory_rows.py " + " ".join(argv or sys.argv[1:])
    lines = [
        f"# Memory forecast on this host for {args.device!r} vs the GPU's max_memory_allocated",
        "",
        f"Command: `{command.strip()}` (measured: {Path(args.results).name}, torch {torch.__version__} here)",
        "",
        "| part | model | strategy | forecast MiB | measured MiB | forecast / measured - 1 | within 0..+3% | note |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for part, model, strategy, forecast, note, measured in rows:
        err = forecast / measured - 1
        lines.append(
            f"| {part} | {model} | {strategy} | {forecast / MIB:,.0f} | {measured / MIB:,.0f} | {err:+.1%} "
            f"| {'yes' if 0 <= err <= 0.03 else 'no'} | {note} |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
