"""`memfit plan`: the plan and per-rank forecast of a preset for a budget, on fake tensors (the
model is built on the meta device: an 8B model plans on a laptop); `memfit calibrate`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

import memfit
from memfit._plan._calibrate import cache_path, calibrate
from memfit._plan._time import PROFILES, default_profile
from memfit.cli._data import batch_at
from memfit.cli._output import write_json
from memfit.models import PRESETS, Preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PlanConfig:
    model: str = "bert"
    budget: str = "1GB"
    world_size: int = 1
    shard_size: int | None = None  # hybrid sharding: ranks per shard group (None: all ranks)
    dtype: str = "fp32"  # parameters, gradients and optimizer state all in this dtype
    device_profile: str | None = None  # a name from PROFILES, "calibrated", or None (this machine's device's named one)
    layers: int | None = None
    hidden: int | None = None
    seq: int | None = None
    batch: int | None = None
    json: str | None = None
    auto: bool = False  # search the configuration (memfit.autoconfigure) instead of planning one
    global_batch: int | None = None  # with auto: samples per optimizer step (None: free)

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"memfit plan: unknown model {self.model!r}; choose one of {sorted(PRESETS)}")
        memfit.parse_bytes(self.budget)
        if self.world_size < 1:
            raise ValueError("memfit plan: --world-size must be >= 1")
        if self.shard_size is not None and (self.shard_size < 1 or self.world_size % self.shard_size):
            raise ValueError(
                f"memfit plan: --shard-size {self.shard_size} must divide --world-size {self.world_size} "
                "(hybrid sharding: world size = replicas x shard size)"
            )
        if self.global_batch is not None and not self.auto:
            raise ValueError("memfit plan: --global-batch is for --auto (the search over micro-batches)")
        if self.dtype not in DTYPES:
            raise ValueError(f"memfit plan: unknown --dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.device_profile not in (None, "calibrated", *PROFILES):
            raise ValueError(
                f"memfit plan: unknown --device-profile {self.device_profile!r}; choose one of "
                f"{sorted(PROFILES)} or 'calibrated'"
            )

    def preset(self) -> Preset:
        return PRESETS[self.model].resized(layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch)


def plan_command(cfg: PlanConfig) -> memfit.Plan:
    preset = cfg.preset()
    print(f"plan: building {cfg.model} on the meta device", flush=True)
    with torch.device("meta"):  # planning needs shapes only: nothing is allocated
        model = preset.build().to(DTYPES[cfg.dtype])
    batch = batch_at(preset.arch, preset.shape.batch, preset.shape.seq, step=0)
    params = sum(p.numel() for p in model.parameters())
    device, why = _device_profile(cfg.device_profile)
    layout = f"world size {cfg.world_size}"
    if cfg.shard_size and cfg.shard_size < cfg.world_size:
        layout += f" as {cfg.world_size // cfg.shard_size} replicas x {cfg.shard_size} shards (hybrid sharding)"
    print(
        f"{cfg.model}: {preset.arch} {preset.resolved()}\n{params / 1e9:.2f}B parameters, AdamW, {cfg.dtype} "
        f"parameters, gradients and optimizer state, {layout}\ntime priced on: {device.name} ({why})\n"
    )
    if cfg.auto:
        return auto_command(cfg, model, batch, device)
    print(f"plan: profiling one batch on fake tensors and solving for {cfg.budget}", flush=True)
    plan = memfit.plan(
        model, batch, budget=cfg.budget, world_size=cfg.world_size, shard_size=cfg.shard_size, device_profile=device
    )
    print(plan.table())
    if cfg.json:
        write_json(cfg.json, plan.to_dict())
    return plan


def auto_command(cfg: PlanConfig, model: torch.nn.Module, batch, device: memfit.DeviceProfile) -> memfit.Plan:
    """`memfit plan --auto`: the configurations searched, why each lost, and the chosen one's plan."""
    global_batch = f"global batch {cfg.global_batch}" if cfg.global_batch else "no global batch (accumulation 1)"
    print(f"plan: searching configurations for {cfg.budget} per rank, {global_batch}", flush=True)
    result = memfit.autoconfigure(
        model,
        batch,
        budget=cfg.budget,
        world_size=cfg.world_size,
        global_batch=cfg.global_batch,
        device_profile=device,
        shard_sizes=[cfg.shard_size] if cfg.shard_size else None,
    )
    print(result.table(limit=20))
    print()
    print(result.plan.table())
    if cfg.json:
        write_json(cfg.json, {"auto": result.to_dict(), "plan": result.plan.to_dict()})
    return result.plan


def _device_profile(name: str | None) -> tuple[memfit.DeviceProfile, str]:
    """The profile ``--device-profile`` names, or the default: the named profile of this
    machine's accelerator, or "cpu" (never a cached calibration: see [Note: The default device
    profile]); with the reason, for the header."""
    from memfit._plan._calibrate import device_profile

    if name is not None:
        profile = device_profile(name)
        return profile, profile.source or "--device-profile"
    target = "cuda" if torch.cuda.is_available() else "cpu"
    profile = default_profile(target)
    return profile, (
        f"the default for this machine's {target}, {profile.source}; --device-profile h100|h200|a100|cpu names "
        "the target, 'calibrated' measures this machine"
    )


@dataclass
class CalibrateConfig:
    device: str = "cpu"
    cpu_time: bool = False  # one thread, timed in process CPU time (steady on a shared machine)


def calibrate_command(cfg: CalibrateConfig) -> memfit.DeviceProfile:
    """Measure this machine's rates for the planner's time model and cache them."""
    threads = torch.get_num_threads()
    if cfg.cpu_time:
        torch.set_num_threads(1)
    try:
        profile = calibrate(cfg.device, cpu_time=cfg.cpu_time)
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(asdict(profile), indent=1))
    print(
        f"cached in {cache_path(torch.device(cfg.device).type)}: plan with it by "
        "`memfit plan ... --device-profile calibrated`"
    )
    return profile
