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
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

import memfit
from memfit.cli._bench_dist import run_distributed
from memfit.cli._data import batch_at
from memfit.cli._flags import decision_kind
from memfit.cli._launch import choose_device, warn_world_size
from memfit.cli._measure import Result, run
from memfit.cli._output import Output, plot, write_json
from memfit.models._spec import ModelSpec, layer_class, resolve

STRATEGIES = (*(k.value for k in memfit.DecisionKind), "planned")  # each DecisionKind on every block, or planned
COMPARE = ("torch.utils.checkpoint",)


@dataclass
class BenchConfig:
    """What `memfit bench` runs (each field is a command-line flag)."""

    model: str = "bert"  # a preset, a config.json or pkg.module:function (memfit.models._spec.resolve)
    strategies: tuple[str, ...] | None = None  # one process only; None: all of STRATEGIES
    budget: str | None = None  # for "planned" (one process); default: halfway between "full" and "keep"
    compare: bool = False  # add torch.utils.checkpoint (with --world-size: torch FSDP2)
    world_size: int = 1  # > 1: DDP vs memfit sharding on spawned ranks
    device: str = "auto"  # auto (CUDA when there is a GPU), cpu or cuda
    layers: int | None = None  # shape overrides
    hidden: int | None = None
    seq: int | None = None
    batch: int | None = None
    warmup: int = 2
    repeats: int = 5
    json: str | None = None
    plot: str | None = None
    spec: ModelSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size > 1 and (self.strategies is not None or self.budget is not None):
            raise ValueError(
                f"memfit bench: --strategies and --budget apply to one process; --world-size {self.world_size} "
                "compares DDP with memfit sharding (add --compare for torch FSDP2). Drop them, or drop --world-size"
            )
        self.strategies = tuple(STRATEGIES if self.strategies is None else map(decision_kind, self.strategies))
        self.spec = resolve(
            self.model, layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch, command="memfit bench"
        )
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"memfit bench: unknown strategies {bad}; choose from {list(STRATEGIES)}")
        if self.world_size < 1:
            raise ValueError("memfit bench: --world-size must be >= 1")
        # --device cuda without a GPU, or more ranks than GPUs, fails here
        spawned = self.world_size if self.world_size > 1 else None
        choose_device(self.device, env={"LOCAL_RANK": str(self.world_size - 1)}, spawned=spawned, where="memfit bench")
        if self.warmup < 1 or self.repeats < 1:
            raise ValueError("memfit bench: --warmup and --repeats must be >= 1")
        if self.budget is not None:
            memfit.parse_bytes(self.budget)  # validates


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
