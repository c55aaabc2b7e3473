"""`memfit plan`: measure one batch of a preset and print the plan and forecast for a budget."""

from __future__ import annotations

from dataclasses import dataclass

import memfit
from memfit.cli._data import batch_at
from memfit.cli._launch import warn_world_size
from memfit.cli._output import write_json
from memfit.models import PRESETS, Preset


@dataclass
class PlanConfig:
    model: str = "bert"
    budget: str = "1GB"
    world_size: int = 1
    layers: int | None = None
    hidden: int | None = None
    seq: int | None = None
    batch: int | None = None
    json: str | None = None

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"memfit plan: unknown model {self.model!r}; choose one of {sorted(PRESETS)}")
        memfit.parse_bytes(self.budget)
        if self.world_size < 1:
            raise ValueError("memfit plan: --world-size must be >= 1")

    def preset(self) -> Preset:
        return PRESETS[self.model].resized(layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch)


def plan_command(cfg: PlanConfig) -> memfit.Plan:
    warn_world_size(cfg.world_size)
    preset = cfg.preset()
    print(f"plan: building {cfg.model} ({preset.arch} {preset.shape})", flush=True)
    model = preset.build()
    batch = batch_at(preset.arch, preset.shape.batch, preset.shape.seq, step=0)
    print(f"plan: measuring one batch (forward and backward) and solving for {cfg.budget}", flush=True)
    plan = memfit.plan(model, batch, budget=cfg.budget, world_size=cfg.world_size)
    print(f"{cfg.model}: {preset.arch} {preset.shape}, AdamW fp32, world size {cfg.world_size}\n")
    print(plan.table())
    if cfg.json:
        write_json(cfg.json, plan.to_dict())
    return plan
