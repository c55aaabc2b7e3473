"""`memfit bench`: what each strategy costs in memory and time, on a real architecture, here.

Single process: every strategy trains its own copy of the same randomly initialised model on
the same tokens (the standard library's sources, byte-level); timed steps interleave the
strategies; then one MemoryMeter step each gives the peak.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

import memfit
from memfit.cli._data import batch_at
from memfit.cli._launch import warn_world_size
from memfit.cli._measure import MIB, run
from memfit.models import PRESETS, Preset

STRATEGIES = ("none", "full", "selective", "offload", "planned")
COMPARE = ("torch.utils.checkpoint",)


@dataclass
class BenchConfig:
    """What `memfit bench` runs (each field is a command-line flag)."""

    model: str = "bert"  # a preset name (memfit.models.PRESETS)
    strategies: tuple[str, ...] = STRATEGIES
    budget: str | None = None  # for "planned"; default: halfway between "full" and "none"
    compare: bool = False  # add torch.utils.checkpoint (with --world-size: torch FSDP2)
    world_size: int = 1  # > 1: DDP vs memfit sharding on spawned gloo ranks
    layers: int | None = None  # shape overrides
    hidden: int | None = None
    seq: int | None = None
    batch: int | None = None
    warmup: int = 2
    repeats: int = 5
    json: str | None = None
    plot: str | None = None
    preset: Preset = field(init=False)

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"memfit bench: unknown model {self.model!r}; choose one of {sorted(PRESETS)}")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"memfit bench: unknown strategies {bad}; choose from {list(STRATEGIES)}")
        if self.world_size < 1:
            raise ValueError("memfit bench: --world-size must be >= 1")
        if self.warmup < 1 or self.repeats < 1:
            raise ValueError("memfit bench: --warmup and --repeats must be >= 1")
        if self.budget is not None:
            memfit.parse_bytes(self.budget)  # validates
        self.preset = PRESETS[self.model].resized(
            layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch
        )


def _prepare(strategy: str, base: nn.Module, preset: Preset) -> nn.Module:
    model = _copy(base)
    if strategy == "torch.utils.checkpoint":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        memfit.Decision.parse(strategy).apply_to(model, preset.layer_class())
    model.train()
    return model


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def bench(cfg: BenchConfig, console=None) -> list[dict]:
    """Run the strategies of ``cfg``; returns one row per strategy (also printed as a table)."""
    out = _Output(console)
    preset = cfg.preset
    s = preset.shape
    if cfg.world_size > 1:
        return _bench_distributed(cfg, out)
    batch = batch_at(preset.arch, s.batch, s.seq, step=0)
    base = preset.build()
    names = [x for x in cfg.strategies if x != "planned"] + (list(COMPARE) if cfg.compare else [])
    if "none" not in names:
        names.insert(0, "none")
    models = {n: _prepare(n, base, preset) for n in names}
    plan = None
    if "planned" in cfg.strategies:
        budget = cfg.budget
        if budget is None:
            out.say("planned: measuring the all-full and none peaks to set the budget halfway")
            layer_paths = [p for p, m in base.named_modules() if isinstance(m, preset.layer_class())]
            probe = memfit.plan(base, batch, budget="1TB")
            none_peak = memfit.Plan.fixed(dict.fromkeys(layer_paths, "keep"), probe.profile).measure(base, batch)
            full_peak = memfit.Plan.fixed(dict.fromkeys(layer_paths, "full"), probe.profile).measure(base, batch)
            budget = int((none_peak + full_peak) / 2)
            plan = memfit.plan(base, batch, budget=budget, profile=probe.profile)
        else:
            plan = memfit.plan(base, batch, budget=budget)
        models["planned"] = plan.apply(_copy(base))
        out.say(plan.table())
    total = 2 * len(models) + cfg.repeats
    with out.progress(total) as advance:
        results = run(models, batch, cfg.warmup, cfg.repeats, progress=advance)
    none = next(r for r in results if r.name == "none")
    rows = []
    for r in results:
        rows.append(
            {
                "strategy": r.name,
                "peak_bytes": r.peak,
                "activation_bytes_at_peak": r.breakdown["activations_and_other"],
                "step_seconds": r.time,
                "overhead_vs_none": r.time / none.time - 1,
                "peak_vs_none": r.peak / none.peak,
                "loss": r.first_loss,
                **({"budget": plan.budget, "predicted_peak": plan.predicted_peak} if r.name == "planned" else {}),
            }
        )
    out.table(rows, f"{cfg.model}: {preset.arch} {s}, AdamW fp32, {torch.get_num_threads()} threads")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": _jsonable(cfg), "results": rows}, f, indent=2)
    if cfg.plot:
        _plot(rows, cfg.plot, cfg.model)
    return rows


def _bench_distributed(cfg: BenchConfig, out: _Output) -> list[dict]:
    from memfit.cli._bench_dist import run_distributed

    warn_world_size(cfg.world_size)
    strategies = ("DDP", "memfit", *(("torch FSDP2",) if cfg.compare else ()))
    out.say(f"{cfg.world_size} spawned gloo ranks: {', '.join(strategies)}")
    rows = run_distributed(cfg.preset, cfg.world_size, strategies, cfg.warmup, cfg.repeats)
    ddp = rows[0]
    for r in rows:
        r["overhead_vs_none"] = r["step_seconds"] / ddp["step_seconds"] - 1
        r["peak_vs_none"] = r["peak_bytes"] / ddp["peak_bytes"]
    s = cfg.preset.shape
    out.table(rows, f"{cfg.model}: {cfg.preset.arch} {s}, per rank, {cfg.world_size} ranks (ratios against DDP)")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": _jsonable(cfg), "results": rows}, f, indent=2)
    if cfg.plot:
        _plot(rows, cfg.plot, f"{cfg.model}, {cfg.world_size} ranks")
    return rows


def _jsonable(cfg: BenchConfig) -> dict:
    d = {k: v for k, v in asdict(cfg).items() if k != "preset"}
    d["shape"] = asdict(cfg.preset.shape)
    return d


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["step_seconds"], r["peak_bytes"] / MIB)
        ax.annotate(r["strategy"], (r["step_seconds"], r["peak_bytes"] / MIB), fontsize=8)
    ax.set_xlabel("step time (s, median)")
    ax.set_ylabel("peak memory (MiB, live tensors)")
    ax.set_title(f"memfit bench: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Output:
    """Rich output when rich is installed (the `cli` extra), plain text otherwise."""

    def __init__(self, console=None) -> None:
        try:
            from rich.console import Console
        except ImportError:  # pragma: no cover - rich is in the cli extra
            Console = None  # noqa: N806
        self.console = console or (Console(width=None if os.isatty(1) else 120) if Console else None)

    def say(self, text: str) -> None:
        if self.console:
            self.console.print(text, highlight=False)
        else:
            print(text)

    def progress(self, total: int):
        import contextlib

        if not self.console or not os.isatty(1):
            return contextlib.nullcontext(lambda msg: None)
        from rich.progress import Progress

        @contextlib.contextmanager
        def bar():
            with Progress(console=self.console, transient=True) as p:
                task = p.add_task("measuring", total=total)
                yield lambda msg: p.update(task, advance=1, description=msg)

        return bar()

    def table(self, rows: list[dict], title: str) -> None:
        header = ["strategy", "peak MiB", "step s", "overhead vs none", "peak vs none", "loss"]
        cells = [
            [
                r["strategy"],
                f"{r['peak_bytes'] / MIB:.1f}",
                f"{r['step_seconds']:.3f}",
                f"{r['overhead_vs_none']:+.1%}",
                f"{r['peak_vs_none']:.2f}x",
                f"{r['loss']:.4f}",
            ]
            for r in rows
        ]
        if self.console:
            from rich.table import Table

            t = Table(title=title)
            for h in header:
                t.add_column(h, justify="left" if h == "strategy" else "right")
            for c in cells:
                t.add_row(*c)
            self.console.print(t)
        else:
            print(title)
            print(" | ".join(header))
            for c in cells:
                print(" | ".join(c))
