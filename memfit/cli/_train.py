"""`memfit train`: a real training loop on a sharded model; resumable, survives a killed rank.

One process (`memfit train ...`) or many (`torchrun --nproc-per-node N -m memfit train ...`,
and torchrun's rendezvous across machines). The model (a preset, a local HF config.json or
a factory: memfit.models._spec) is sharded with FullyShardedDataParallel (one unit per
block), optionally checkpointed; AdamW with linear warm-up and cosine decay, gradient
accumulation (no_sync on all but the last micro-batch), clipping by the global norm, periodic
evaluation on a held-out split. Every step is a function of the step number alone: the batch
is the step's window of the tokens split over ranks, and the RNG is seeded from (seed, step,
rank). So a run resumed from a checkpoint computes exactly what the uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

import torch
import torch.distributed as dist

import memfit
from memfit.cli import _checkpoints
from memfit.cli._data import Tokens, load_tokens, window_batch
from memfit.cli._flags import DEVICE_HELP, DEVICES, decision_kind, flag
from memfit.cli._launch import choose_device, init_process_group, pg_timeout
from memfit.cli._log import RunLog
from memfit.cli._output import write_json
from memfit.models import PRESETS
from memfit.models._spec import ModelSpec, layer_class, loss_of, resolve, vocab_size

# Not OFFLOAD: a block's input offloaded to disk under sharded training is untested
CHECKPOINTING = tuple(k.value for k in memfit.DecisionKind if k is not memfit.DecisionKind.OFFLOAD)
_SHAPE = "override the preset's {} (default: the preset's)"


@dataclass
class TrainConfig:
    """What `memfit train` runs: each field is a command-line flag (its metadata the flag's help
    and argparse keywords; See [Note: Flags from the config]) and a config-file key."""

    model: str = field(
        default="bert",
        metadata=flag(f"a preset ({', '.join(sorted(PRESETS))}), a config.json path, or pkg.module:function"),
    )
    data: str | None = field(
        default=None, metadata=flag("text file or directory, or .npy/.bin token ids (default: stdlib sources)")
    )
    tokenizer: str | None = field(default=None, metadata=flag("a local tokenizer.json for text data (default: bytes)"))
    val_fraction: float = field(default=0.05, metadata=flag("tail of the tokens held out for evaluation"))
    eval_every: int = field(default=0, metadata=flag("evaluate every K steps and at the end (0: never)"))
    eval_batches: int = field(default=4, metadata=flag("micro-batches per evaluation"))
    steps: int = field(default=20, metadata=flag("optimizer steps in all"))
    lr: float = field(default=3e-4, metadata=flag("peak learning rate"))
    warmup: int = field(default=2, metadata=flag("linear warm-up steps, then cosine decay"))
    accumulate: int = field(default=1, metadata=flag("micro-batches per step"))  # each of --batch rows per rank
    clip: float = field(default=1.0, metadata=flag("max global gradient norm"))
    checkpointing: str = field(default="full", metadata=flag("per block", choices=CHECKPOINTING, type=decision_kind))
    hybrid_shards: int = field(
        default=0,
        metadata=flag(
            "hybrid sharding: shard over groups of N consecutive ranks (a node), replicate across them (0: over all)",
            metavar="N",
        ),
    )
    layers: int | None = field(default=None, metadata=flag(_SHAPE.format("layers")))
    hidden: int | None = field(default=None, metadata=flag(_SHAPE.format("hidden")))
    seq: int | None = field(default=None, metadata=flag(_SHAPE.format("seq")))
    batch: int | None = field(  # a step: batch x accumulate x world
        default=None, metadata=flag(_SHAPE.format("batch (rows per rank per micro-batch)"))
    )
    seed: int = field(default=0, metadata=flag("initialisation, dropout and masking"))
    checkpoint_dir: str | None = field(default=None, metadata=flag("checkpoints go to DIR/step-N"))
    save_every: int = field(default=0, metadata=flag("save a checkpoint every K steps and at the end"))
    keep_last: int = field(default=0, metadata=flag("keep only the newest N checkpoints (0: all)"))
    resume: str = field(
        default="no",
        metadata=flag(
            "continue from the newest checkpoint in --checkpoint-dir (auto: only if there is one)",
            nargs="?",
            const="yes",
            choices=["no", "yes", "auto"],
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=flag("start afresh in a --checkpoint-dir that holds another run's checkpoints, deleting them"),
    )
    export: str | None = field(
        default=None, metadata=flag("write a safetensors export (from_pretrained loads it) here at the end")
    )
    log_every: int = field(default=1, metadata=flag("print and record metrics every N steps"))
    metrics: str | None = field(default=None, metadata=flag("append metrics here as JSON lines, as the run goes"))
    tensorboard: str | None = field(
        default=None, metadata=flag("TensorBoard log directory (needs the tensorboard package)")
    )
    json: str | None = field(default=None, metadata=flag("write the log and a digest of the final parameters here"))
    device: str = field(default="auto", metadata=flag(DEVICE_HELP, choices=DEVICES))

    def __post_init__(self) -> None:
        choose_device(self.device, where="memfit train")  # --device cuda without a GPU fails here
        self.checkpointing = decision_kind(self.checkpointing)  # "none": the old spelling of "keep"
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"memfit train: unknown checkpointing {self.checkpointing!r}; choose from {CHECKPOINTING}")
        if self.resume not in ("no", "yes", "auto"):
            raise ValueError("memfit train: --resume takes no, yes or auto")
        if (self.resume != "no" or self.save_every or self.overwrite) and not self.checkpoint_dir:
            raise ValueError("memfit train: --resume, --save-every and --overwrite need --checkpoint-dir")
        if self.overwrite and self.resume != "no":
            raise ValueError(
                "memfit train: --overwrite starts afresh, deleting the checkpoints; --resume continues from them: "
                "pass one of the two"
            )
        if min(self.steps, self.accumulate, self.log_every, self.eval_batches) < 1 or self.warmup < 0:
            raise ValueError("memfit train: --steps, --accumulate, --log-every, --eval-batches >= 1, --warmup >= 0")
        if min(self.save_every, self.keep_last, self.eval_every, self.hybrid_shards) < 0:
            raise ValueError("memfit train: --save-every, --keep-last, --eval-every and --hybrid-shards must be >= 0")
        self.spec()  # an unknown model fails here, before any process group forms

    def spec(self) -> ModelSpec:
        return resolve(self.model, layers=self.layers, hidden=self.hidden)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    with memfit.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().to("cpu", copy=True).numpy().tobytes())
    return h.hexdigest()


@dataclass
class _Run:
    """What one run's steps share."""

    cfg: TrainConfig
    spec: ModelSpec
    tokens: Tokens
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    log: RunLog
    rank: int
    world: int
    seq: int
    batch: int
    params: int  # parameters of the whole model (not this rank's shard)
    device: torch.device  # where this rank computes (--device)
    identity: dict | None = None  # what its checkpoints record about it (See memfit/cli/_checkpoints.py)


def _build(cfg: TrainConfig, device: torch.device) -> _Run:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = cfg.spec()
    seq, batch = cfg.seq or spec.seq, cfg.batch or spec.batch
    tokens = load_tokens(cfg.data, cfg.tokenizer, cfg.val_fraction, seq)
    model = spec.build(cfg.seed)
    if device.type != "cpu":  # pragma: no cover (needs a GPU); sharding then computes there
        model = model.to(device)
    vocab = vocab_size(model)
    needed = max(tokens.vocab, tokens.mask_id + 1) if spec.arch == "bert" else tokens.vocab
    if vocab is not None and needed > vocab:
        raise ValueError(
            f"memfit train: the data needs token ids up to {needed - 1} but {cfg.model} embeds {vocab}; "
            "use a model with a larger vocabulary (or a smaller tokenizer)"
        )
    n_params = sum(p.numel() for p in model.parameters())
    block = layer_class(model)
    memfit.Decision.parse(cfg.checkpointing).apply_to(model, block)
    options = memfit.ShardOptions(auto_wrap_policy={block}, mesh=_hybrid_mesh(cfg, world))
    model = cast(torch.nn.Module, memfit.FullyShardedDataParallel(model, options=options))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    log = RunLog(rank, cfg.metrics, cfg.tensorboard)
    n = cfg.hybrid_shards
    hybrid = f" (hybrid: {world // n} replicas x {n} shards)" if n else ""
    log.say(
        f"memfit train: {cfg.model} ({n_params / 1e6:.2f}M parameters, {spec.arch} LM), world size {world}{hybrid}, "
        f"global batch {batch * cfg.accumulate * world} sequences of {seq} tokens "
        f"({cfg.accumulate} x {batch} per rank), {cfg.steps} steps; data: {tokens.source}"
    )
    return _Run(cfg, spec, tokens, model, opt, log, rank, world, seq, batch, n_params, device)


def _hybrid_mesh(cfg: TrainConfig, world: int):
    """--hybrid-shards N: the (world / N) x N mesh, a shard group per N consecutive ranks (a
    node under torchrun), the replicas across them (hybrid sharding); None without it."""
    if not cfg.hybrid_shards:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if world % cfg.hybrid_shards:
        raise ValueError(
            f"memfit train: --hybrid-shards {cfg.hybrid_shards} does not divide the world size {world}; "
            "use the number of processes per node (torchrun --nproc-per-node)"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    shape = (world // cfg.hybrid_shards, cfg.hybrid_shards)
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))


def _step(run: _Run, step: int, measure: bool) -> dict:
    """One optimizer step; its metrics (loss averaged over ranks)."""
    cfg, model, opt = run.cfg, run.model, run.opt
    t0 = time.perf_counter()
    for group in opt.param_groups:
        group["lr"] = cfg.lr_at(step)
    rows = run.batch * cfg.accumulate
    whole = window_batch(run.tokens.train, run.spec.arch, rows * run.world, run.seq, step, cfg.seed, run.tokens.mask_id)
    mine = {k: v[run.rank * rows : (run.rank + 1) * rows].to(run.device) for k, v in whole.items()}
    micro = [{k: v.split(run.batch)[i] for k, v in mine.items()} for i in range(cfg.accumulate)]
    torch.manual_seed(cfg.seed * 1_000_003 + step * run.world + run.rank)
    meter = memfit.MemoryMeter(model=model, optimizer=opt) if measure else None
    total = 0.0
    with meter if meter else contextlib.nullcontext():
        for i, mb in enumerate(micro):
            with contextlib.nullcontext() if i == len(micro) - 1 else model.no_sync():  # type: ignore[operator]
                loss = loss_of(model, mb) / cfg.accumulate
                loss.backward()
            total += loss.item()
        norm = memfit.clip_grad_norm_(model, cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    mean = torch.tensor([total], device=run.device)
    dist.all_reduce(mean)
    entry = {
        "step": step + 1,
        "loss": mean.item() / run.world,
        "grad_norm": float(norm),
        "lr": cfg.lr_at(step),
        "tokens_per_s": rows * run.world * run.seq / (time.perf_counter() - t0),
    }
    if meter:
        entry["peak_bytes"] = meter.peak_bytes  # a step with AdamW state: the steady-state peak
    return entry


@torch.no_grad()
def _evaluate(run: _Run, step: int) -> dict:
    """The mean loss on the held-out tokens: the same --eval-batches windows every time."""
    run.model.eval()
    total = torch.zeros(1, device=run.device)
    for i in range(run.cfg.eval_batches):
        whole = window_batch(run.tokens.val, run.spec.arch, run.batch * run.world, run.seq, i, -1, run.tokens.mask_id)
        mine = {k: v[run.rank * run.batch : (run.rank + 1) * run.batch].to(run.device) for k, v in whole.items()}
        total += loss_of(run.model, mine).float()
    dist.all_reduce(total)
    run.model.train()
    entry = {"step": step, "val_loss": total.item() / (run.world * run.cfg.eval_batches)}
    run.log.say(f"eval at step {step} | val loss {entry['val_loss']:.4f}")
    return entry


def _save(run: _Run, step: int) -> None:
    assert run.cfg.checkpoint_dir is not None and run.identity is not None  # --save-every needs a dir; resume set it
    path = _checkpoints.path_at(run.cfg.checkpoint_dir, step)
    extra = {"step": step, "run": run.identity, "saved_at": time.time()}
    memfit.save_checkpoint(path, run.model, run.opt, extra=extra)
    if run.rank == 0:
        _checkpoints.prune(run.cfg.checkpoint_dir, run.cfg.keep_last, run.identity["id"])
    run.log.say(f"saved checkpoint step {step} ({path})")


def train(cfg: TrainConfig, *, on_step: Callable[[int], object] | None = None) -> dict:
    """Train as ``cfg`` says; returns the log, evaluations, the world size and a digest of the
    final parameters.

    ``on_step(step)``, when given, is called on every rank at the start of each step, with the
    number of steps done so far (a hook for progress reporting, profiling or fault injection).
    """
    # A collective (or the mesh set-up of a restarted group) that outlives the timeout fails,
    # so that torchrun can restart the job instead of waiting for ever.
    _checkpoints.claim(cfg)
    placement = init_process_group(timeout=pg_timeout(), device=cfg.device, where="memfit train")
    run = _build(cfg, placement.device)
    start, run.identity = _checkpoints.resume(cfg, run.model, run.opt, run.log)
    if start >= cfg.steps:
        run.log.say(f"the run is finished: the checkpoint is at step {start} of --steps {cfg.steps}; nothing to train")
    can_eval = cfg.eval_every and len(run.tokens.val) > run.seq + 1
    log: list[dict] = []
    evals: list[dict] = []
    measured, t_run = False, time.perf_counter()
    for step in range(start, cfg.steps):
        if on_step is not None:
            on_step(step)
        measure = not measured and bool(run.opt.state)  # the first step with AdamW state
        entry = _step(run, step, measure)
        measured |= measure
        log.append(entry)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps or measure:
            eta = (time.perf_counter() - t_run) / (done - start) * (cfg.steps - done)
            run.log.step_line(entry, cfg.steps, eta)
            global_batch = run.batch * cfg.accumulate * run.world
            run.log.record({**entry, "world_size": run.world, "global_batch": global_batch, "params": run.params})
        if can_eval and (done % cfg.eval_every == 0 or done == cfg.steps):
            evals.append(_evaluate(run, done))
            run.log.record(evals[-1])
        if cfg.save_every and (done % cfg.save_every == 0 or done == cfg.steps):
            _save(run, done)
    _finish(run)
    result = {"log": log, "eval": evals, "world_size": run.world, "params_sha256": _digest(run.model)}
    if run.rank == 0 and cfg.json:
        write_json(cfg.json, {**result, "config": asdict(cfg)})
    dist.barrier()
    return result


def _finish(run: _Run) -> None:
    run.log.close()
    if run.cfg.export:
        memfit.export_safetensors(run.model, run.cfg.export)
        if run.rank == 0 and run.cfg.tokenizer:
            shutil.copy(run.cfg.tokenizer, os.path.join(run.cfg.export, "tokenizer.json"))
        run.log.say(f"exported safetensors to {run.cfg.export}")
