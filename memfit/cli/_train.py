"""`memfit train`: a real training loop on a sharded model; resumable, survives a killed rank.

One process (`memfit train ...`) or many (`torchrun --nproc-per-node N -m memfit train ...`,
and torchrun's rendezvous across machines). The model (a preset, a local HF config.json or
a factory: memfit.models._spec) is sharded with FullyShardedDataParallel (one unit per
block), optionally checkpointed; AdamW with linear warm-up and cosine decay, gradient
accumulation (See [Note: Reducing accumulated gradients]), clipping by the global norm, periodic
evaluation on a held-out split. Every step is a function of the step number alone: the batch
is the step's window of the tokens split over ranks, and the RNG is seeded from (seed, step,
rank). So a run resumed from a checkpoint computes exactly what the uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn, cast

import torch
import torch.distributed as dist

import memfit
from memfit._plan._tiers import TierChoice
from memfit._shard._layout import end_mesh
from memfit._shard._unit import units_of
from memfit._shard._utils import clip_grads
from memfit.cli import _checkpoints
from memfit.cli._choose import Choice, choose, mixed_precision, picked_before, trials_record, tried
from memfit.cli._config import CHECKPOINTING, TrainConfig
from memfit.cli._data import Tokens, check_first_batch, load_tokens, window_batch
from memfit.cli._launch import init_process_group, pg_timeout, relaunched
from memfit.cli._log import RunLog, plural
from memfit.cli._output import write_json
from memfit.cli._preempt import Preempted, StopRequests, agreed_signal, resume_command
from memfit.cli._progress import phase
from memfit.models._spec import ModelSpec, layer_class, loss_of, settle_loss_type, vocab_size

__all__ = ["CHECKPOINTING", "TrainConfig", "accumulation", "train"]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    # one rank computing on its chunks: they are the full parameters already, and summoning
    # would clone every one of them (writeback=False): the whole model twice in memory
    direct = all(sp.direct for u in units_of(model) for sp in u.params)
    with contextlib.nullcontext() if direct else memfit.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes())  # any dtype
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
    accumulate: int  # micro-batches per step (--accumulate, or from the global batch: See [Note: Elastic restarts])
    identity: dict | None = None  # what its checkpoints record about it (See memfit/cli/_checkpoints.py)
    forecast: float | None = None  # the planner's peak per rank (--budget, --auto), bytes
    chosen: tuple[type, int, str, int] | None = None  # block class, count, checkpointing chosen, shard group
    sharded: bool = True  # shard groups of 2 or more ranks (See [Note: Reducing accumulated gradients])
    trials_pick: dict | None = None  # what --trials picked, recorded in checkpoints (a restart keeps it)


def _build(cfg: TrainConfig, device: torch.device) -> _Run:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = cfg.spec()
    seq, batch = cfg.seq or spec.seq, cfg.batch or spec.batch
    tokens = load_tokens(cfg.data, cfg.tokenizer, cfg.val_fraction, seq)
    model = spec.build(cfg.seed)
    settle_loss_type(model)
    vocab = vocab_size(model)
    needed = max(tokens.vocab, tokens.mask_id + 1) if spec.arch == "bert" else tokens.vocab
    if vocab is not None and needed > vocab:
        raise ValueError(
            f"memfit train: the data needs token ids up to {needed - 1} but {cfg.model} embeds {vocab}; "
            "use a model with a larger vocabulary (or a smaller tokenizer)"
        )
    first = window_batch(tokens.train, spec.arch, batch, seq, 0, cfg.seed, tokens.mask_id)
    check_first_batch(cfg.COMMAND, model, first)  # a sequence longer than its positions: refused here
    n_params = sum(p.numel() for p in model.parameters())
    block = layer_class(model)
    wanted = cfg.global_batch or cfg.accumulate * batch * world
    # resumed at another world size, the run keeps the checkpoint's global batch: a --budget plan
    # holds the gradients of the accumulation it will use, --auto searches at that global batch
    # (See [Note: Elastic restarts])
    saved = _checkpoints.saved_extra(cfg)
    recorded = saved.get("global_batch")
    resumed = recorded if not cfg.global_batch and isinstance(recorded, int) and recorded > 0 else None
    planned = accumulation(resumed, batch, world) if resumed and not cfg.auto else wanted // (batch * world)
    data = (tokens, spec.arch, seq, batch)
    meshes: dict[int, object] = {}  # per shard group size: the trials' and the run's the same groups

    def shard(model: torch.nn.Module, c: Choice):
        if c.hybrid_shards not in meshes:
            meshes[c.hybrid_shards] = _hybrid_mesh(c.hybrid_shards, world)
        return _sharded(cfg, model, block, c, meshes[c.hybrid_shards], device)

    def step_of(c: Choice) -> Callable[[], object]:  # --trials: a step of the configuration, built afresh
        fresh = spec.build(cfg.seed)
        settle_loss_type(fresh)
        built, opt = shard(fresh, c)
        quiet = RunLog(rank, None, None)  # the trials record nothing
        trial = _Run(
            cfg, spec, tokens, built, opt, quiet, rank, world, seq, c.batch, n_params, device, c.accumulate or 1
        )
        trial.sharded = (c.hybrid_shards or world) > 1
        return lambda: _descend(trial, _micro_batches(trial, 0))

    searching = f"{'searching configurations' if cfg.auto else 'planning'} for {cfg.budget} per rank"
    with phase(cfg.COMMAND, searching, shown=bool(cfg.budget) and rank == 0):
        chosen = choose(cfg, model, block, data, world, device.type, planned, global_batch=cfg.global_batch or resumed)
    picked = None
    timed = {"mixed_precision": cfg.mixed_precision, "seq": seq, "device": device.type}  # what --trials times under
    if cfg.trials and chosen.search is not None:  # See [Note: Trying configurations]
        picked = picked_before(saved.get("trials_pick"), chosen.search, list(chosen.decisions), world, cfg, timed)
    if cfg.trials and chosen.search is not None and picked is None:
        del model  # each trial builds its own: one whole model in host memory at a time
        gc.collect()
        with phase(cfg.COMMAND, f"timing the {cfg.trials} fastest-predicted configurations", shown=rank == 0):
            picked = tried(cfg, chosen.search, list(chosen.decisions), world, step_of, device)
        model = spec.build(cfg.seed)
        settle_loss_type(model)
    chosen = picked or chosen
    _end_meshes(meshes, keep=chosen.hybrid_shards)
    model, opt = shard(model, chosen)
    log = RunLog(rank, cfg.metrics, cfg.tensorboard)
    batch = chosen.batch
    accumulate = chosen.accumulate or accumulation(cfg.global_batch or cfg.accumulate * batch * world, batch, world)
    if chosen.tiers is not None and chosen.tiers.state == "host":  # See [Note: Planned tiers]
        opt = _host_step(cfg, model, opt, chosen.tiers, accumulate)
    run = _Run(cfg, spec, tokens, model, opt, log, rank, world, seq, batch, n_params, device, accumulate)
    run.forecast = chosen.forecast
    run.chosen = (block, len(chosen.decisions), chosen.about, chosen.hybrid_shards)  # for the start line
    run.sharded = (chosen.hybrid_shards or world) > 1
    run.trials_pick = trials_record(chosen, world, timed) if picked is not None else None
    return run


def _sharded(cfg: TrainConfig, model: torch.nn.Module, block: type, choice: Choice, mesh, device: torch.device):
    """``model`` (in host memory) with ``choice``'s checkpointing, sharded as it says (over
    ``mesh``, hybrid; None: over every rank), and its AdamW.
    Sharding copies each rank's rows to ``device``: the whole model is never there (the point of
    sharding), only the chunks and one unit's gathered parameters."""
    choice.apply(model)
    host = choice.tiers is not None and choice.tiers.state == "host" and device.type != "cpu"
    options = memfit.ShardOptions(
        auto_wrap_policy={block}, mesh=mesh, device=device, offload="cpu" if host else None,
        reshard_after_forward=choice.reshard_after_forward, mixed_precision=mixed_precision(cfg.mixed_precision),
    )  # fmt: skip
    model = cast(torch.nn.Module, memfit.FullyShardedDataParallel(model, options=options))
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def _host_step(
    cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, tiers: TierChoice, accumulate: int
) -> torch.optim.Optimizer:
    """The planned tiers applied: the host step (fused, per unit in backward) over the state in
    host memory, clipping at --clip, stepping in the last of --accumulate backwards; the planned
    blocks' units on the disk tier in --disk."""
    disk = [model.get_submodule(p) for p in tiers.disk_blocks]
    with warnings.catch_warnings():  # the start line says the tiers; the fused step is the host step's
        warnings.filterwarnings("ignore", message="memfit.host_optimizer")
        return memfit.host_optimizer(
            model, opt, accumulate=accumulate, max_norm=cfg.clip, disk=cfg.disk if disk else None,
            disk_modules=disk or None,
        )  # fmt: skip


def _configuration(run: _Run, block: type, blocks: int, checkpointing: str, n: int) -> str:
    """The start line: what the flags resolved to (the model, layout, batch, checkpointing, saving)."""
    cfg, world = run.cfg, run.world
    layout = f"hybrid: {world // n} replicas x {n} shards" if n else f"sharded over {world}"
    saving = "no --checkpoint-dir: nothing is saved"
    if cfg.checkpoint_dir:
        every = f"every {plural(cfg.save_every, 'step')}, " if cfg.save_every else ""
        keep = f", keeping the newest {cfg.keep_last}" if cfg.keep_last else ""
        saving = f"checkpoints to {cfg.checkpoint_dir} {every}at the end and on SIGTERM/SIGINT{keep}"
    micro = f"{run.accumulate} micro-batch{'es' * (run.accumulate > 1)} of {run.batch} per rank"
    return (
        f"memfit train: {cfg.model} ({run.params / 1e6:.2f}M parameters, {run.spec.arch} LM), world size {world} "
        f"({layout}, {run.device.type}/{dist.get_backend()}), global batch {run.batch * run.accumulate * world} "
        f"sequences of {run.seq} tokens ({micro}), {plural(cfg.steps, 'step')}; "
        f"activation checkpointing on {blocks} {block.__name__} blocks: {checkpointing}"
        f"{'; mixed precision ' + cfg.mixed_precision if cfg.mixed_precision != 'no' else ''}; {saving}; "
        f"data: {run.tokens.source}"
    )


def _end_meshes(meshes: dict, keep: int) -> None:
    """End the process groups of the --trials' meshes the run does not use, after their models
    are freed (the same on every rank)."""
    ended = [m for n, m in meshes.items() if n != keep and m is not None]
    if ended:
        dist.barrier()
    for mesh in ended:
        end_mesh(mesh)


def _hybrid_mesh(shards: int, world: int):
    """--hybrid-shards N: the (world / N) x N mesh, a shard group per N consecutive ranks (a
    node under torchrun), the replicas across them (hybrid sharding); None without it."""
    if not shards:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if world % shards:
        raise ValueError(
            f"memfit train: --hybrid-shards {shards} does not divide the world size {world}; "
            "use the number of processes per node (torchrun --nproc-per-node)"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    shape = (world // shards, shards)
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))


# [Note: Reducing accumulated gradients]
# With gradient accumulation a sharded run (shard groups of 2 or more ranks) reduce-scatters
# every micro-batch's gradients, so that only 1/s of them is held between micro-batches, as
# torchtitan does with FSDP2; under no_sync each rank would hold every gradient whole until the
# last micro-batch (a 2-rank Llama at accumulation 4 measured 51.3 MiB against the 47.33 MiB
# its --budget plan forecast, which holds 1/s). That is what the planner forecasts and prices
# (memfit/_plan/_autoconfig.py [Note: Searching configurations]: a reduce-scatter per micro-
# batch). A replicated run (shard groups of 1) all-reduces once, after the last micro-batch:
# it holds every gradient either way, and the planner prices one all-reduce.


def _step(run: _Run, step: int, measure: bool, stop: StopRequests) -> tuple[dict, int | None]:
    """One optimizer step; its metrics (loss averaged over ranks) and the signal every rank
    agreed to stop for after it (None: go on). One host sync of its own: See [Note: One read per step]."""
    cfg, model, opt = run.cfg, run.model, run.opt
    t0 = time.perf_counter()
    for group in opt.param_groups:
        group["lr"] = cfg.lr_at(step)
    micro = _micro_batches(run, step)
    torch.manual_seed(cfg.seed * 1_000_003 + step * run.world + run.rank)
    meter = memfit.MemoryMeter(model=model, optimizer=opt) if measure else None
    with meter if meter else contextlib.nullcontext():
        total, norm = _descend(run, micro)
    peak = meter.peak_bytes if meter else 0
    loss_sum, norm_f, votes, seconds, peaks = _agree(run, total, norm, stop.votes(), time.perf_counter() - t0, peak)
    slowest = max(range(run.world), key=lambda r: seconds[r])
    entry = {
        "step": step + 1,
        "loss": loss_sum / run.world,
        "grad_norm": norm_f,
        "lr": cfg.lr_at(step),
        "tokens_per_s": run.accumulate * run.batch * run.world * run.seq / (time.perf_counter() - t0),
        "step_s_slowest": seconds[slowest],
        "slowest_rank": slowest,
    }
    if meter:
        entry["peak_bytes"] = peak  # a step with AdamW state: the steady-state peak (this rank's)
        entry["peak_bytes_per_rank"] = [int(p) for p in peaks]
    return entry, agreed_signal(votes)


def _descend(run: _Run, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches' forward and backward, the clipping and the optimizer step: this rank's
    summed loss (on the device) and the gradients' norm, neither read."""
    model, opt = run.model, run.opt
    total = torch.zeros((), dtype=torch.float64, device=run.device)  # this rank's loss, summed on the device
    for i, mb in enumerate(micro):
        reduce = run.sharded or i == len(micro) - 1  # See [Note: Reducing accumulated gradients]
        with contextlib.nullcontext() if reduce else model.no_sync():  # type: ignore[operator]
            loss = loss_of(model, mb) / run.accumulate
            loss.backward()
        total += loss.detach()
    host = getattr(opt, "_memfit_host_step", None)  # it clips, at opt.step() (See [Note: The host step])
    if host is None:
        norm, _ = clip_grads(model, run.cfg.clip)  # read with the loss, in _agree
    opt.step()
    if host is not None:
        norm = torch.tensor(host.last_norm, device=run.device)
    opt.zero_grad(set_to_none=True)
    return total, norm


# [Note: One read per step]
# A step reads the device once, in `_agree`: one all-reduce of a small vector that holds this
# rank's summed loss (accumulated on the device, never read per micro-batch), the gradients'
# norm (the same on every rank: rank 0's slot only), its stop request
# (See [Note: Stopping on a signal] in memfit/cli/_preempt.py), its step time and its measured
# peak (each rank in a slot of its own, the others zero, so the sum is the list over ranks), then
# one read of the result. The stop request has to be read every step (a step in flight is the
# last one), so the loss, the slowest rank's time and the peaks ride in that read for nothing.
# The vector is filled with `fill_` (a kernel with a scalar argument, no host-to-device copy,
# which on CUDA would wait for the stream). The clipping reads nothing (clip_grads multiplies
# by the clamped coefficient on the device, as torch.nn.utils.clip_grad_norm_), except where
# the shards are offloaded: their gradients are clipped on the host after one read.
# A rank's time runs from its step's start to its arrival at this all-reduce; the step's own
# collectives (the backward's reduce-scatters, the norm's all-reduce) make the ranks wait for
# each other, so the times differ by less than the ranks' work does: the slowest is the step's
# time, and `slowest_rank` (in --metrics) a hint only. On an accelerator the norm's read has
# waited for the optimizer step's kernels (not testable here).


def _agree(run: _Run, total: torch.Tensor, norm: torch.Tensor, votes: list[float], seconds: float, peak: int):
    """Sum over ranks of [loss, gradient norm (rank 0's), stop votes..., per-rank step seconds,
    per-rank peaks]; the step's one read."""
    w, n = run.world, len(votes)
    shared = torch.zeros(2 + n + 2 * w, dtype=torch.float64, device=run.device)
    shared[0].copy_(total)
    if run.rank == 0:
        shared[1].copy_(norm)
    for i, v in enumerate(votes):
        shared[2 + i].fill_(v)
    shared[2 + n + run.rank].fill_(seconds)
    shared[2 + n + w + run.rank].fill_(float(peak))
    dist.all_reduce(shared)
    values = shared.tolist()  # the host sync
    return values[0], values[1], values[2 : 2 + n], values[2 + n : 2 + n + w], values[2 + n + w :]


def _micro_batches(run: _Run, step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's rows of the step's window, on its device (from pinned memory, without
    waiting, on an accelerator), split into --accumulate micro-batches."""
    rows = run.batch * run.accumulate
    cfg = run.cfg
    whole = window_batch(run.tokens.train, run.spec.arch, rows * run.world, run.seq, step, cfg.seed, run.tokens.mask_id)
    mine = {k: _to_device(v[run.rank * rows : (run.rank + 1) * rows], run.device) for k, v in whole.items()}
    return [{k: v.split(run.batch)[i] for k, v in mine.items()} for i in range(run.accumulate)]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # pragma: no cover (needs a GPU)


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


def _save(run: _Run, step: int, last: bool) -> str:
    """Save after ``step`` steps; with --async-save, in the background unless ``last`` (the end
    of the run or a stop: See [Note: Asynchronous checkpoints])."""
    assert run.cfg.checkpoint_dir is not None and run.identity is not None  # only with a dir; resume set it
    path = _checkpoints.path_at(run.cfg.checkpoint_dir, step)
    global_batch = run.batch * run.accumulate * run.world
    extra = {
        "step": step,
        "run": run.identity,
        "saved_at": time.time(),
        "global_batch": global_batch,
        "world": run.world,
    }
    if run.trials_pick is not None:
        extra["trials_pick"] = run.trials_pick
    background = run.cfg.async_save and not last
    # Waits for the save in flight first, raising its error: a failed background write stops the run.
    memfit.save_checkpoint(path, run.model, run.opt, extra=extra, async_=background)
    if run.rank == 0:  # the newest may still be writing: it is not counted until it is whole
        _checkpoints.prune(run.cfg.checkpoint_dir, run.cfg.keep_last, run.identity["id"])
    run.log.say(
        f"{'saving' if background else 'saved'} checkpoint step {step} ({path}{', in the background' * background})"
    )
    return path


def _save_due(cfg: TrainConfig, done: int) -> bool:
    """Whether a checkpoint is written after ``done`` steps: every --save-every and at the end,
    whenever there is a --checkpoint-dir (and on a stop: See [Note: Stopping on a signal])."""
    every = cfg.save_every and done % cfg.save_every == 0
    return bool(cfg.checkpoint_dir) and (done == cfg.steps or bool(every))


def _expandable_segments(device: torch.device) -> None:
    """On CUDA, unless the user configured the allocator: expandable segments, so that cached
    blocks the step cannot reuse (fragmentation, which no forecast includes) stay small, as
    torchtitan does. See [Note: The allocator beside the tensors]. Needs a GPU to take effect."""
    if device.type == "cuda" and not ({"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & os.environ.keys()):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # pragma: no cover (GPU)


def train(cfg: TrainConfig, *, on_step: Callable[[int], object] | None = None) -> dict:
    """Train as ``cfg`` says; returns the log, evaluations, the world size and a digest of the
    final parameters.

    ``on_step(step)``, when given, is called on every rank at the start of each step, with the
    number of steps done so far (a hook for progress reporting, profiling or fault injection).
    SIGTERM or SIGINT stops the run after the step in flight, saved, and raises
    :class:`~memfit.cli._preempt.Preempted` (See [Note: Stopping on a signal]).
    """
    # A collective (or the mesh set-up of a restarted group) that outlives the timeout fails,
    # so that torchrun can restart the job instead of waiting for ever.
    _checkpoints.claim(cfg)
    placement = init_process_group(timeout=pg_timeout(), device=cfg.device, where="memfit train")
    _expandable_segments(placement.device)
    with StopRequests(dist.get_rank()) as stop:
        run = _build(cfg, placement.device)
        return _loop(run, stop, on_step)


def _loop(run: _Run, stop: StopRequests, on_step: Callable[[int], object] | None) -> dict:
    cfg = run.cfg
    start, run.identity, resumed = _checkpoints.resume(cfg, run.model, run.opt, run.log)
    _keep_global_batch(run, resumed)
    assert run.chosen is not None  # _build sets it
    run.log.say(_configuration(run, *run.chosen))  # after a resume: its accumulation is the run's
    if start >= cfg.steps:
        run.log.say(f"the run is finished: the checkpoint is at step {start} of --steps {cfg.steps}; nothing to train")
    can_eval = cfg.eval_every and len(run.tokens.val) > run.seq + 1
    log: list[dict] = []
    evals: list[dict] = []
    saved: list[str] = []
    stopped: int | None = None
    measured, t_run = False, time.perf_counter()
    for step in range(start, cfg.steps):
        if on_step is not None:
            on_step(step)
        measure = not measured and bool(run.opt.state)  # the first step with AdamW state
        entry, stopped = _step(run, step, measure, stop)
        measured |= measure
        log.append(entry)
        done = step + 1
        stopped = stopped if done < cfg.steps else None  # a stop after the last step: the run ends as usual
        if done % cfg.log_every == 0 or done == cfg.steps or measure or stopped:
            eta = (time.perf_counter() - t_run) / (done - start) * (cfg.steps - done)
            run.log.step_line(entry, cfg.steps, eta)
            global_batch = run.batch * run.accumulate * run.world
            run.log.record({**entry, "world_size": run.world, "global_batch": global_batch, "params": run.params})
        if can_eval and not stopped and (done % cfg.eval_every == 0 or done == cfg.steps):
            evals.append(_evaluate(run, done))
            run.log.record(evals[-1])
        if _save_due(cfg, done) or (stopped and cfg.checkpoint_dir):
            saved.append(_save(run, done, last=bool(stopped) or done == cfg.steps))
        if stopped:
            break
    tokens = len(log) * run.accumulate * run.batch * run.world * run.seq
    run.log.summary(len(log), tokens, time.perf_counter() - t_run, saved)
    if stopped:
        return _stop(run, stopped, start + len(log), saved[-1] if saved else None, log, evals)
    _finish(run)
    result = {"log": log, "eval": evals, "world_size": run.world, "params_sha256": _digest(run.model)}
    if run.rank == 0 and cfg.json:
        write_json(cfg.json, {**result, "config": asdict(cfg)})
    dist.barrier()
    return result


# [Note: Elastic restarts]
# A step trains on the global rows [step x G, (step + 1) x G) of the data (G = --batch x
# accumulate x world size; rank r takes its slice of them), so a run that keeps G keeps its data
# order at any world size. Each checkpoint records G and the world size; a run resumed at another
# world size (torchrun --nnodes 1:2 restarting with fewer nodes, or another --nproc-per-node) keeps
# the checkpoint's G by changing the accumulation (when --batch x world size divides it: an error
# otherwise, saying what to pass), unless --global-batch says otherwise. The gradient is the mean
# over the same G rows, so the loss curve continues as the unchanged run's would, to rounding (the
# sums run in another order) and dropout (each rank draws its own masks); the model and optimizer
# states are resharded by memfit.load_checkpoint. A --budget plan is made for that accumulation
# (its gradients are held over the micro-batches), read from the newest checkpoint before
# anything is built on the device; --auto searches micro-batch x accumulation at that G (its
# pick, not --batch, divides it).


def accumulation(global_batch: int, batch: int, world: int) -> int:
    """Micro-batches per step for ``global_batch`` sequences at --batch ``batch`` on ``world`` ranks."""
    if global_batch % (batch * world):
        raise ValueError(
            f"memfit train: a global batch of {global_batch} sequences is not a multiple of --batch {batch} x "
            f"world size {world}; pass a --batch whose product with {world} divides {global_batch} "
            "(or --global-batch to change the global batch)"
        )
    return global_batch // (batch * world)


def _keep_global_batch(run: _Run, saved: dict) -> None:
    """A resumed run keeps its checkpoint's global batch (See [Note: Elastic restarts])."""
    was, now = saved.get("global_batch"), run.batch * run.accumulate * run.world
    if not isinstance(was, int) or was == now:
        return
    if run.cfg.global_batch is not None:
        run.log.say(f"the global batch changes from the checkpoint's {was} to --global-batch {now} sequences")
        return
    before = run.accumulate
    run.accumulate = accumulation(was, run.batch, run.world)
    run.log.say(
        f"world size {run.world} (the checkpoint's run had {saved.get('world', '?')}): accumulating "
        f"{run.accumulate} micro-batches of {run.batch} per rank (was {before}) keeps its global batch of "
        f"{was} sequences"
    )


def _stop(run: _Run, signum: int, done: int, path: str | None, log: list[dict], evals: list[dict]) -> NoReturn:
    """End a run a signal stopped (See [Note: Stopping on a signal]): one line, then Preempted."""
    name = signal.Signals(signum).name
    if path:
        run.log.say(
            f"memfit train: stopped by {name} after step {done} of {run.cfg.steps}; saved checkpoint {path}; "
            f"continue with: {relaunched(resume_command(sys.argv))}"
        )
    else:
        run.log.say(
            f"memfit train: stopped by {name} after step {done} of {run.cfg.steps}; nothing could be saved "
            "(no --checkpoint-dir: pass one to make a run resumable)"
        )
    run.log.close()
    if run.rank == 0 and run.cfg.json:
        stopped = {"signal": name, "step": done, "checkpoint": path}
        write_json(run.cfg.json, {"log": log, "eval": evals, "world_size": run.world, "preempted": stopped})
    dist.barrier()  # every rank leaves after the line is out
    raise Preempted(signum, done, path)


def _finish(run: _Run) -> None:
    run.log.close()
    host = getattr(run.opt, "_memfit_host_step", None)
    if host is not None:  # the disk tier's files (See [Note: The disk tier])
        host.close()
    if run.cfg.export:
        memfit.export_safetensors(run.model, run.cfg.export)
        if run.rank == 0 and run.cfg.tokenizer:
            shutil.copy(run.cfg.tokenizer, os.path.join(run.cfg.export, "tokenizer.json"))
        run.log.say(f"exported safetensors to {run.cfg.export}")
