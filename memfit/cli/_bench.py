"""`memfit bench`: what each strategy costs in memory and time, on a real architecture, here.

Single process: every strategy trains its own copy of the same randomly initialised model on
the same tokens (the standard library's sources, byte-level); timed steps interleave the
strategies; then one MemoryMeter step each gives the peak. With --world-size N, DDP against
memfit sharding on N spawned ranks (memfit.cli._bench_dist), the same loop across ranks.
``--device`` (auto: CUDA when there is a GPU) places the models and batches; spawned ranks use
NCCL on CUDA and gloo on the CPU.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict

import torch
from torch import nn

import memfit
from memfit.cli._bench_dist import run_distributed
from memfit.cli._config import STRATEGIES, BenchConfig
from memfit.cli._data import batch_at, check_first_batch
from memfit.cli._launch import choose_device, warn_world_size
from memfit.cli._measure import Result, run
from memfit.cli._output import Output, plot, write_json
from memfit.models._spec import layer_class

COMPARE = ("torch.utils.checkpoint",)
__all__ = ["STRATEGIES", "BenchConfig", "bench"]


def bench(cfg: BenchConfig, console=None) -> list[dict]:
    """Run the strategies of ``cfg``; returns one row per strategy (also printed as a table)."""
    out = Output(console)
    spec = cfg.spec
    rows_seq = f"batch {spec.batch} x seq {spec.seq}"
    if cfg.world_size > 1:
        rows = _distributed_rows(cfg, out)
        title = f"{cfg.model}: {spec.about}, {rows_seq} per rank, {cfg.world_size} ranks (ratios against DDP)"
        label = f"{cfg.model}, {cfg.world_size} ranks"
    else:
        rows = _single_rows(cfg, out)
        title = f"{cfg.model}: {spec.about}, {rows_seq}, AdamW fp32, {torch.get_num_threads()} threads"
        label = cfg.model
    out.table(rows, title)
    if cfg.json:
        config = _jsonable(cfg)
        config["budget"] = next((r["budget"] for r in rows if "budget" in r), cfg.budget)  # the planned row's
        write_json(cfg.json, {"config": config, "results": rows})
        out.say(f"wrote {cfg.json}")
    if cfg.plot:
        plot(rows, cfg.plot, label)
        out.say(f"wrote the plot {cfg.plot}")
    return rows


def _single_rows(cfg: BenchConfig, out: Output) -> list[dict]:
    """One process: every strategy (plus "keep", the baseline) on its own copy of one model."""
    spec = cfg.spec
    device = choose_device(cfg.device, where="memfit bench").device
    batch = {k: v.to(device) for k, v in batch_at(spec.arch, spec.batch, spec.seq, step=0).items()}
    base = spec.build(0).to(device)
    check_first_batch(cfg.COMMAND, base, batch)
    assert cfg.strategies is not None  # __post_init__ fills it
    names = [x for x in cfg.strategies if x != "planned"] + (list(COMPARE) if cfg.compare else [])
    if "keep" not in names:
        names.insert(0, "keep")
    models = {n: _prepare(n, base) for n in names}
    plan = None
    if "planned" in cfg.strategies:
        plan = _plan(cfg, base, batch, out)
        models["planned"] = plan.apply(copy.deepcopy(base))
        out.say(plan.table())
    with out.progress(2 * len(models) + cfg.repeats) as advance:
        results = run(models, batch, cfg.warmup, cfg.repeats, progress=advance)
    rows = []
    for r in results:
        planned = {}
        if r.name == "planned" and plan is not None:
            planned = {"budget": plan.budget, "predicted_peak": plan.predicted_peak}
        rows.append(
            _row(r, activation_bytes_at_peak=r.breakdown["activations_and_other"], breakdown=r.breakdown, **planned)
        )
    return _with_ratios(rows, next(row for row in rows if row["strategy"] == "keep"))


def _prepare(strategy: str, base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base)
    if strategy == "torch.utils.checkpoint":
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(
                f"memfit bench: --compare runs torch.utils.checkpoint through transformers' "
                f"gradient_checkpointing_enable(), which {type(model).__name__} lacks; drop --compare"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    else:
        memfit.Decision.parse(strategy).apply_to(model, layer_class(model))
    model.train()
    return model


def _plan(cfg: BenchConfig, base: nn.Module, batch: dict, out: Output) -> memfit.Plan:
    """The plan for --budget or, without one, for halfway between the all-full and all-keep peaks."""
    if cfg.budget is not None:
        return memfit.plan(base, batch, budget=cfg.budget)
    out.say("planned: measuring the all-full and all-keep peaks to set the budget halfway")
    layer_paths = [p for p, m in base.named_modules() if isinstance(m, layer_class(base))]
    probe = memfit.plan(base, batch, budget="1TB")
    keep_peak = memfit.Plan.fixed(dict.fromkeys(layer_paths, "keep"), probe.profile).measure(base, batch)
    full_peak = memfit.Plan.fixed(dict.fromkeys(layer_paths, "full"), probe.profile).measure(base, batch)
    return memfit.plan(base, batch, budget=int((keep_peak + full_peak) / 2), profile=probe.profile)


def _distributed_rows(cfg: BenchConfig, out: Output) -> list[dict]:
    """N spawned ranks: DDP (the baseline), memfit sharding and, with --compare, torch FSDP2."""
    warn_world_size(cfg.world_size)
    with torch.device("meta"):  # shapes only: the ranks would each fail on a batch the model cannot take
        shapes = cfg.spec.build(0)
    check_first_batch(cfg.COMMAND, shapes, batch_at(cfg.spec.arch, cfg.spec.batch, cfg.spec.seq, 0))
    strategies = ("DDP", "memfit", *(("torch FSDP2",) if cfg.compare else ()))
    out.say(f"{cfg.world_size} spawned ranks: {', '.join(strategies)}")
    results = run_distributed(_spec_args(cfg), cfg.world_size, strategies, cfg.warmup, cfg.repeats, cfg.device)
    rows = [_row(r, breakdown_rank0=r.breakdown) for r in results]  # the peak's split: rank 0's
    return _with_ratios(rows, rows[0])


def _row(r: Result, **extra) -> dict:
    return {
        "strategy": r.name,
        "peak_bytes": r.peak,
        "step_seconds": r.time,
        "step_seconds_each": list(r.times),  # every timed repeat, for the spread
        "loss": r.first_loss,
        **extra,
    }


def _with_ratios(rows: list[dict], base: dict) -> list[dict]:
    """Add each row's step-time overhead and peak ratio against ``base`` ("keep" in one
    process, "DDP" on many ranks), and the baseline's name."""
    for r in rows:
        r["baseline"] = base["strategy"]
        r["overhead_vs_baseline"] = r["step_seconds"] / base["step_seconds"] - 1
        r["peak_vs_baseline"] = r["peak_bytes"] / base["peak_bytes"]
    return rows


def _spec_args(cfg: BenchConfig) -> dict:
    """What each spawned rank resolves its model from (a ModelSpec's builder does not pickle)."""
    return {"name": cfg.model, "layers": cfg.layers, "hidden": cfg.hidden, "seq": cfg.seq, "batch": cfg.batch}


def _jsonable(cfg: BenchConfig) -> dict:
    d = {k: v for k, v in asdict(cfg).items() if k != "spec"}
    d.update(model_about=cfg.spec.about, seq=cfg.spec.seq, batch=cfg.spec.batch)
    return d
