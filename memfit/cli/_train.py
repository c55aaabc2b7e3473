"""`memfit train`: a real training loop on a sharded model; resumable, survives a killed rank.

One process (`memfit train ...`) or many (`torchrun --nproc-per-node N -m memfit train ...`,
and torchrun's rendezvous across machines). The model is sharded with
FullyShardedDataParallel (one unit per layer), optionally checkpointed; AdamW with linear
warm-up and cosine decay, gradient accumulation (no_sync on all but the last micro-batch),
clipping by the global norm. Every step is a function of the step number alone: the batch is
the step's window of the corpus split over ranks, and the RNG is seeded from (seed, step,
rank). So a run resumed from a checkpoint computes exactly what the uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import memfit
from memfit.cli._data import batch_at
from memfit.cli._launch import init_process_group, pg_timeout
from memfit.cli._output import write_json
from memfit.models import PRESETS, Preset

CHECKPOINTING = ("none", "full", "selective")


@dataclass
class TrainConfig:
    """What `memfit train` runs (each field is a command-line flag)."""

    model: str = "bert"
    steps: int = 20
    lr: float = 3e-4
    warmup: int = 2
    accumulate: int = 1  # micro-batches per step, each of --batch rows per rank
    clip: float = 1.0
    checkpointing: str = "full"
    layers: int | None = None
    hidden: int | None = None
    seq: int | None = None
    batch: int | None = None  # rows per rank per micro-batch (a step: batch x accumulate x world)
    seed: int = 0
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: str = "no"  # "no", "yes" (a checkpoint must exist) or "auto" (if one exists)
    json: str | None = None

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"memfit train: unknown model {self.model!r}; choose one of {sorted(PRESETS)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"memfit train: unknown checkpointing {self.checkpointing!r}; choose from {CHECKPOINTING}")
        if self.resume not in ("no", "yes", "auto"):
            raise ValueError("memfit train: --resume takes no, yes or auto")
        if self.resume != "no" or self.save_every:
            if not self.checkpoint_dir:
                raise ValueError("memfit train: --resume and --save-every need --checkpoint-dir")
        if min(self.steps, self.accumulate) < 1 or self.warmup < 0:
            raise ValueError("memfit train: --steps and --accumulate must be >= 1, --warmup >= 0")

    def preset(self) -> Preset:
        return PRESETS[self.model].resized(layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _resume(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the checkpoint that --resume asks for into ``model`` and ``opt``; the step to start at."""
    if cfg.resume == "no":
        return 0
    if os.path.isfile(os.path.join(cfg.checkpoint_dir, "memfit.json")):
        try:
            return memfit.load_checkpoint(cfg.checkpoint_dir, model, opt)["step"]
        except RuntimeError as e:  # another model's checkpoint, a damaged one: say which
            raise ValueError(f"memfit train: cannot resume from {cfg.checkpoint_dir!r}: {e}") from e
    if cfg.resume == "yes":
        raise ValueError(
            f"memfit train: --resume, but {cfg.checkpoint_dir!r} holds no checkpoint; run without "
            "--resume (or with --resume auto) to start from scratch"
        )
    return 0


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    with memfit.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().clone().numpy().tobytes())
    return h.hexdigest()


def train(cfg: TrainConfig, *, on_step: Callable[[int], object] | None = None) -> dict:
    """Train as ``cfg`` says; returns the log, the world size and a digest of the final parameters.

    ``on_step(step)``, when given, is called on every rank at the start of each step, with the
    number of steps done so far (a hook for progress reporting, profiling or fault injection).
    """
    # A collective (or the mesh set-up of a restarted group) that outlives the timeout fails,
    # so that torchrun can restart the job instead of waiting for ever.
    init_process_group(timeout=pg_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    preset = cfg.preset()
    shape = preset.shape
    model = preset.build(cfg.seed)
    memfit.Decision.parse(cfg.checkpointing).apply_to(model, preset.layer_class())
    model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={preset.layer_class()})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start = _resume(cfg, model, opt)
    log: list[dict] = []
    for step in range(start, cfg.steps):
        if on_step is not None:
            on_step(step)
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        rows = shape.batch * cfg.accumulate
        whole = batch_at(preset.arch, rows * world, shape.seq, step=step, seed=cfg.seed)
        mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in whole.items()}
        micro = [{k: v.split(shape.batch)[i] for k, v in mine.items()} for i in range(cfg.accumulate)]
        torch.manual_seed(cfg.seed * 1_000_003 + step * world + rank)
        meter = memfit.MemoryMeter(model=model, optimizer=opt) if step == start else None
        total = 0.0
        with meter if meter else contextlib.nullcontext():
            for i, mb in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = model(**mb).loss / cfg.accumulate
                    loss.backward()
                total += loss.item()
            norm = memfit.clip_grad_norm_(model, cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        entry = {
            "step": step + 1,
            "loss": mean.item() / world,
            "grad_norm": norm,
            "lr": cfg.lr_at(step),
            "tokens_per_s": shape.batch * cfg.accumulate * world * shape.seq / (time.perf_counter() - t0),
        }
        if meter:
            entry["peak_bytes"] = meter.peak_bytes
        log.append(entry)
        if rank == 0:
            peak = f"  peak {entry['peak_bytes'] / 2**20:.1f} MiB" if meter else ""
            print(
                f"step {step + 1}/{cfg.steps}  loss {entry['loss']:.4f}  lr {entry['lr']:.2e}  "
                f"{entry['tokens_per_s']:.0f} tok/s{peak}",
                flush=True,
            )
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            memfit.save_checkpoint(cfg.checkpoint_dir, model, opt, step=step + 1)
    result = {"log": log, "world_size": world, "params_sha256": _digest(model)}
    if rank == 0 and cfg.json:
        write_json(cfg.json, result)
    dist.barrier()
    return result
