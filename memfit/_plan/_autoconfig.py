"""`memfit.autoconfigure`: the fastest configuration of a training job that fits a memory budget
(micro-batch, gradient accumulation, sharding layout, checkpoint decisions, head), on paper."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from memfit._checkpoint import Offload
from memfit._plan import _trial
from memfit._plan._budget import format_bytes, parse_bytes
from memfit._plan._calibrate import check_ranks
from memfit._plan._calibrate import device_profile as _device_profile
from memfit._plan._candidate import Candidate, Layout
from memfit._plan._candidates import find_candidates
from memfit._plan._comm import Units, micro_batch_comm
from memfit._plan._plan import Plan, PlanError, _device_type, _solve_tiers, replicas_forecast
from memfit._plan._profile import DECISIONS, _fake_copy, profile_model
from memfit._plan._profile_types import ModelProfile
from memfit._plan._solve import smallest_budget
from memfit._plan._step import Inputs, _make_optimizer
from memfit._plan._target import target_of
from memfit._plan._tiers import Tiers, TiersError, tiers_of
from memfit._plan._time import CostRecorder, DeviceProfile, OpCost
from memfit._shard._mixed import MixedPrecision

# [Note: Searching configurations]
# A configuration is a micro-batch size b, gradient accumulation a (a x b x W = the global
# batch, when one is given), a layout (one process; replicated over W ranks, DDP-style; sharded
# over groups of s ranks dividing W, s = W fully sharded, with reshard_after_forward True or
# False) and, for those, the planner's own choice of per-block decisions and head at the
# budget: memfit.plan's solver on the profile of micro-batch b. The model is profiled once per
# micro-batch size (on fake tensors; cached) and the optimizer step once (it does not depend on
# b); every layout re-uses the profile: the solver and the forecast take the layout as an
# argument. A step's time is named terms (see step_terms): a x (forward and backward +
# recompute) + the optimizer step over 1/s of the state + the exposed communication of [Note:
# Pricing communication]. The pick has the most tokens per second among the configurations
# whose per-rank forecast peak fits; every other one lost on memory (no plan fits) or on time.
# A larger micro-batch never needs less memory, so sizes above one that no layout fits are not
# profiled. With accumulation a > 1 the gradients accumulated so far (1/s of them sharded, all
# of them replicated) are alive through every later micro-batch's forward and backward: they
# are added to the term the forward starts from (before_blocks), an upper bound in a sharded
# block's backward, where the gradient shards of the blocks after it are counted already, and to
# the backward before the blocks (tail_transient), where the last micro-batch's gradients are
# whole beside them (one process, a tiny GPT-2 at micro-batch 1 x 8: measured 43.83 MiB, 6.1 MiB
# of gradients above the forecast without this term, at that moment). On one shard without
# gathered copies (replicated, or one process in fp32) the backward adds into them in place:
# nothing is counted beside them (_Moments.of in _solve.py). A
# replicated layout is forecast as memfit's units over a W x 1 mesh run it (memfit train,
# memfit.shard), which hold no copy of the gradients: 2 gloo ranks of a tiny BERT at 4 x 2,
# 2 x 4 and 1 x 8 measured 37.07, 27.74 and 24.42 MiB against 37.07, 27.74 and 24.74 forecast
# (a DDP-style copy and the gradients counted twice had forecast 37.90, 32.34 and 31.61). torch
# DDP's reducer holds a copy of every gradient (gradient_as_bucket_view=False, its default):
# 29.02 MiB at 2 x 4 and 1 x 8 there (1.28 and 4.28 MiB above the forecast): a run under torch
# DDP needs up to one gradient copy more than the forecast.

_TERMS = ("compute", "recompute", "optimizer", "exposed_communication")


@dataclass(frozen=True)
class AutoConfig:
    """What :func:`memfit.autoconfigure` chose (``best``) and every configuration it priced,
    the pick first, then the others by tokens per second, then those that do not fit."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    budget: int
    global_batch: int | None
    tokens_per_sample: int
    device: str
    skipped: tuple[int, ...] = ()  # micro-batch sizes not profiled: a smaller one fit no layout
    trial_scale: float | None = None  # measured / priced step, the median over measure()'s runs; None: none ran
    trial_weight: float | None = None  # the measured time's weight in a run's expected step (the rest: scaled price)

    @property
    def plan(self) -> Plan:
        assert self.best.plan is not None  # the pick fits
        return self.best.plan

    @property
    def micro_batch(self) -> int:
        return self.best.micro_batch

    @property
    def accumulation(self) -> int:
        return self.best.accumulation

    @property
    def layout(self) -> Layout:
        return self.best.layout

    @property
    def tokens_per_second(self) -> float:
        return self.best.tokens_per_second

    @property
    def step_time(self) -> float:
        return self.best.step_time

    def measure(
        self,
        step_of: Callable[[Candidate], Callable[[], object]],
        *,
        top: int = 3,
        steps: int = 5,
        warmup: int = 2,
        group=None,
        device: torch.device | str | None = None,
    ) -> AutoConfig:
        """This search with its ``top`` fastest-predicted configurations that fit run for real,
        the one with the most tokens per second expected picked (its measured step weighed
        against its price scaled as the runs measured: ``trial_scale``, ``trial_weight`` and
        each candidate's ``expected``; see the Note below): ``step_of(candidate)`` builds
        the configuration (the model sharded as ``candidate.layout`` says, ``candidate.plan``'s
        decisions applied, its optimizer) and returns one training step of it (``accumulation``
        micro-batches of ``micro_batch`` rows, then the optimizer step); ``warmup`` steps run,
        then the median of ``steps`` more, each timed on the slowest rank of ``group`` with
        ``device`` synchronised (default: the current accelerator, else the CPU). Where the
        device's allocator keeps statistics, a configuration whose peak goes over the budget
        there is refused, as is one that runs out of memory on every rank alike (PlanError when
        every one is; one that fails on some ranks only, inside a collective, leaves the others
        waiting until the process group's timeout). A collective: every rank of the world size
        searched calls it with the same search. See [Note: Trying configurations]."""
        return _trial.measure(self, step_of, top, steps, warmup, group, device)

    def table(self, limit: int | None = None) -> str:
        """The pick, its runner-ups and why each lost, then the pick's time terms."""
        rows = self.candidates if limit is None else self.candidates[:limit]
        w = self.best.layout.world_size
        ran = any(c.measured is not None for c in self.candidates)
        columns = f"{'measured ms':>13}{'expected ms':>13}" if ran else ""
        batch = "free (accumulation 1)" if self.global_batch is None else str(self.global_batch)
        lines = [
            f"configurations for world size {w}, global batch {batch}, budget {format_bytes(self.budget)} per rank, "
            f"time priced on {self.device} ({self.tokens_per_sample} tokens a sample)",
            f"  {'micro':>5} {'accum':>5}  {'layout':<28}{'head':<8}{'peak/rank':>11}{'step ms':>10}{'tokens/s':>11}"
            f"{'host ms':>9}{'device ms':>10}{columns}  lost on",
        ]
        for c in rows:
            head = c.plan.head if c.plan else "-"
            step = f"{c.step_time * 1e3:.1f}" if c.fits else "-"
            tps = f"{c.tokens_per_second:.0f}" if c.fits else "-"
            # See [Note: Host and device time]: the kept step's host and device seconds, which bounds it
            known = c.fits and "host" in c.time
            split = f"{c.time['host'] * 1e3:>9.1f}{c.time['device'] * 1e3:>10.1f}" if known else f"{'-':>9}{'-':>10}"
            mark = "*" if c is self.best else " "
            measured = ""
            if ran:
                measured = f"{c.measured * 1e3:.1f}" if c.measured is not None else "-"
                expected = f"{c.expected * 1e3:.1f}" if c.expected is not None else "-"
                measured = f"{measured:>13}{expected:>13}"
            lines.append(
                f"{mark} {c.micro_batch:>5} {c.accumulation:>5}  {c.layout.describe():<28}{head:<8}"
                f"{format_bytes(c.peak):>11}{step:>10}{tps:>11}{split}{measured}  {c.lost or 'chosen'}"
            )
        if limit is not None and len(self.candidates) > limit:
            lines.append(f"  ... {len(self.candidates) - limit} more (AutoConfig.table())")
        if self.skipped:
            lines.append(f"  micro-batches {list(self.skipped)} not tried: a smaller one fits no layout")
        if ran and self.trial_scale is not None and self.trial_weight is not None:
            weight = self.trial_weight
            lines.append(
                f"  expected ms = step ms x {self.trial_scale:.2f} (trial scale: the median measured / predicted of "
                f"those tried); tried ones: {weight:.2f} x measured + {1 - weight:.2f} x that (weight: the share of "
                "the scaled prediction's error that the steps' own spread does not explain); only tried ones are picked"
            )
        return "\n".join([*lines, "", *self._chosen()])

    def _chosen(self) -> list[str]:
        c, p = self.best, self.plan
        kinds = {k: list(p.decisions.values()).count(k) for k in DECISIONS if k in p.decisions.values()}
        t = c.time
        return [
            f"chosen: micro-batch {c.micro_batch} x accumulation {c.accumulation}, {c.layout.describe()}, "
            f"head {p.head}, blocks {kinds}",
            f"  predicted step {_ms(t['step'])} = compute {_ms(t['compute'])} + recompute and offload "
            f"{_ms(t['recompute'])} + optimizer {_ms(t['optimizer'])} + exposed communication "
            f"{_ms(t['exposed_communication'])} (of {_ms(t['communication'])} on the links; with "
            f"{t['collectives']:.0f} collectives' host work)",
            f"  per rank and step: all-gather {format_bytes(t['all_gather_bytes'])}, reduce-scatter "
            f"{format_bytes(t['reduce_scatter_bytes'])}, all-reduce {format_bytes(t['all_reduce_bytes'])}",
            f"  predicted peak {format_bytes(c.peak)} per rank at {p.forecast['at']}",
            *([_trial.describe(c)] if c.measured is not None else []),
        ]

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "global_batch": self.global_batch,
            "tokens_per_sample": self.tokens_per_sample,
            "device_profile": self.device,
            "skipped_micro_batches": list(self.skipped),
            "trial_scale": self.trial_scale,
            "trial_weight": self.trial_weight,
            "candidates": [c.to_dict() for c in self.candidates],  # the pick first
        }


def autoconfigure(
    model: nn.Module,
    example_batch: Inputs,
    *,
    budget: int | float | str,
    world_size: int,
    global_batch: int | None = None,
    device_profile: str | DeviceProfile | None = None,
    loss_fn: Callable | None = None,
    optimizer: str = "adamw",
    micro_batches: list[int] | None = None,
    shard_sizes: list[int] | None = None,
    decisions: tuple[str, ...] = DECISIONS,
    chunk_head: bool | None = None,
    tokens_per_sample: int | None = None,
    max_micro_batch: int = 64,
    mixed_precision: MixedPrecision | None = None,
    host_budget: int | float | str | None = None,
    disk: str | None = None,
    disk_budget: int | float | str | None = None,
    disk_bandwidth: float | None = None,
    progress: Callable[[str], None] | None = None,
    max_norm: float | None = None,
    overlap: bool = True,
) -> AutoConfig:
    """The configuration with the most predicted tokens per second whose forecast per-rank peak
    fits ``budget``: micro-batch size, gradient accumulation, sharding layout (replicated,
    fully or hybrid sharded, reshard_after_forward True or False) and memfit.plan's per-block
    decisions and head at that budget. On paper: the model is profiled on fake tensors once
    per micro-batch size and nothing runs on ``world_size`` ranks. See [Note: Searching
    configurations] and [Note: Pricing communication].

    Args:
        model, example_batch, loss_fn, optimizer, decisions, chunk_head: as for
            :func:`memfit.plan`. The batch's tensors whose first dimension is its batch size
            (that of its first tensor) are resized to each micro-batch.
        budget: per rank; bytes or a string such as ``"80GB"``.
        world_size: ranks of the job (data parallel: each sees its own micro-batches).
        global_batch: samples per optimizer step (micro-batch x accumulation x world_size);
            None: free, accumulation 1.
        device_profile: what time is priced on (as for memfit.plan; its link figures price
            the collectives).
        micro_batches: sizes to try (default: the powers of two dividing global_batch /
            world_size and that quotient; without a global batch the powers of two up to
            ``max_micro_batch``).
        shard_sizes: shard group sizes to try (default: every divisor of ``world_size``; 1
            is replication).
        tokens_per_sample: default: the first tensor's elements per sample (a sequence length).
        mixed_precision: as for memfit.plan; replicated layouts of more than one rank are
            searched under it where it sums gradients in fp32 (``reduce_dtype=torch.float32``),
            else left out ([Note: Forecasts under mixed precision]).
        host_budget, disk, disk_budget, disk_bandwidth: as for memfit.plan: each configuration's
            plan chooses the tiers of the model state too (its ``plan.tiers``); a configuration
            whose tiers fit no budget does not fit. The tiers' time counts once a step.
        progress: called with a line as the search reaches each micro-batch size and as it
            has priced its layouts (`memfit plan --auto` prints them while it works).
        max_norm, overlap: as for memfit.plan (the disk tier's path); its accumulation is
            each configuration's, in no_sync before the last micro-batch where the layout is
            replicated (as memfit train runs it: its reduce priced once).

    Raises:
        PlanError: no configuration fits; the message gives the smallest budget that does.
    """
    budget_bytes = parse_bytes(budget)
    device = _device_profile(device_profile, _device_type(model))
    check_ranks(device, world_size, "memfit.autoconfigure")
    first = _batch_size(example_batch)
    tokens = tokens_per_sample or max(1, _first_tensor(example_batch).numel() // first)
    blocks = find_candidates(model)
    opts: dict[str, Any] = {"loss_fn": loss_fn, "optimizer": optimizer, "decisions": decisions, "device": device}
    opts["mixed_precision"] = mixed_precision

    def profile_of(b: int) -> ModelProfile:
        batch = _resize(example_batch, first, b)
        return profile_model(model, batch, blocks, chunk_head=chunk_head is not False, **opts)

    opt_costs = optimizer_costs(model, optimizer, target_of(device).foreach)  # See [Note: The target's op stream]
    search = Search(budget_bytes, world_size, global_batch, device, opt_costs, tokens)
    params = sum(1 for p in model.parameters() if p.requires_grad)
    # See [Note: Planned tiers]
    tiers = tiers_of(host_budget, disk, disk_budget, disk_bandwidth, max_norm, overlap=overlap)
    search = dataclasses.replace(search, decisions=decisions, chunk_head=chunk_head, params=params, tiers=tiers)
    sizes = micro_batch_sizes(world_size, global_batch, micro_batches, max_micro_batch)
    layouts = _layouts(world_size, shard_sizes)
    if mixed_precision is not None and world_size > 1 and not replicas_forecast(mixed_precision):
        layouts = [layout for layout in layouts if layout.shard_size > 1]  # [Note: Forecasts under mixed precision]
        if not layouts:
            raise ValueError(
                f"memfit.autoconfigure: shard_sizes={shard_sizes} leaves only replicated layouts, which are "
                "forecast under mixed_precision with reduce_dtype=torch.float32 only; pass it, or allow a shard "
                "size above 1"
            )
    return search.run(profile_of, sizes, layouts, progress)


@dataclass(frozen=True)
class Search:
    """The search of [Note: Searching configurations] over profiles from ``profile_of(b)``."""

    budget: int
    world_size: int
    global_batch: int | None
    device: DeviceProfile
    opt_costs: list[OpCost]  # the optimizer step's ops over the whole state (optimizer_costs)
    tokens: int  # per sample
    decisions: tuple[str, ...] = DECISIONS
    chunk_head: bool | None = None
    params: int = 0  # trainable parameters: the units' hooks cost per parameter ([Note: Host and device time])
    tiers: Tiers | None = None  # the model state's tiers, planned per configuration (memfit.plan's)

    def run(
        self,
        profile_of: Callable[[int], ModelProfile],
        sizes: list[int],
        layouts: list[Layout],
        progress: Callable[[str], None] | None = None,
    ) -> AutoConfig:
        """Each micro-batch size profiled and priced at every layout, smallest first, until one
        fits no layout; ``progress``: told each size's start and its outcome, in one line each."""
        priced: list[Candidate] = []
        skipped: tuple[int, ...] = ()
        say = progress or (lambda line: None)
        for i, b in enumerate(sizes):
            where = f"micro-batch {b} ({i + 1} of at most {len(sizes)} sizes)"
            say(f"{where}: profiling on fake tensors")
            profile = profile_of(b)
            accumulation = 1 if self.global_batch is None else self.global_batch // (b * self.world_size)
            found = [self.price(profile, b, accumulation, layout) for layout in layouts]
            priced += found
            fits = sum(c.fits for c in found)
            say(f"{where}: {fits} of {len(layouts)} layouts fit ({len(priced)} configurations priced so far)")
            if not fits:
                skipped = tuple(sizes[i + 1 :])
                break
        return _choose(priced, self.budget, self.global_batch, self.tokens, self.device.name, skipped)

    def price(self, profile: ModelProfile, b: int, accumulation: int, layout: Layout) -> Candidate:
        """One configuration: the planner's decisions at the budget and the step's time terms."""
        shard = layout.sharding
        profile = held_gradients(profile, layout, accumulation)
        no_sync = accumulation > 1 and layout.shard_size == 1  # its disk path (memfit train's)
        tiers = self.tiers and dataclasses.replace(self.tiers, accumulate=accumulation, no_sync=no_sync)
        try:
            tier, head, chosen = _solve_tiers(
                profile, self.budget, shard, self.decisions, self.chunk_head, tiers, self.device.name
            )
        except (PlanError, TiersError):
            least = _least_head(profile, self.chunk_head)
            return Candidate(b, accumulation, layout, None, smallest_budget(least, shard, self.decisions))
        plan = Plan(
            budget=self.budget,
            decisions={blk.path: d for blk, d in zip(profile.blocks, chosen)},
            profile=profile,
            sharding=shard,
            offload=Offload("disk" if self.device.name in ("cpu", "calibrated-cpu") else "cpu"),
            head=head,
            tiers=tier,
        )
        time = step_terms(plan, layout, accumulation, self.device, self.opt_costs, self.params)
        samples = b * accumulation * layout.world_size
        return Candidate(b, accumulation, layout, plan, plan.predicted_peak, time, samples * self.tokens / time["step"])


def held_gradients(profile: ModelProfile, layout: Layout, accumulation: int) -> ModelProfile:
    """``profile`` with the gradients a layout holds beyond one micro-batch's step: those
    accumulated (1/s each). See [Note: Searching configurations]."""
    grads = profile.grad_rest_bytes + sum(blk.grad_bytes for blk in profile.blocks)
    shards = -(-int(grads * profile.grad_shard_scale) // layout.shard_size)  # in the shards' dtype
    accumulated = shards if accumulation > 1 else 0
    return dataclasses.replace(
        profile,
        accumulating=accumulation > 1,
        before_blocks=profile.before_blocks + accumulated,
        tail_transient=profile.tail_transient + accumulated,
    )


def _least_head(profile: ModelProfile, chunk_head: bool | None) -> ModelProfile:
    if chunk_head is not False and profile.head_chunked is not None:
        return dataclasses.replace(profile, head_transient=min(profile.head_chunked, profile.head_transient))
    return profile


def step_terms(
    plan: Plan, layout: Layout, accumulation: int, device: DeviceProfile, opt_costs: list[OpCost], params: int = 0
):
    """Named terms of a step's time (seconds) and its communication (ring bytes per rank):
        step = accumulation x (compute + recompute) + optimizer + exposed_communication
    compute: a micro-batch's forward and backward with every activation kept (the profile's
    priced step less its optimizer step), with the host time of memfit's units' hooks over
    ``params`` parameters where W > 1 (the larger of host and device where they overlap: [Note:
    Host and device time]); recompute: the plan's extra time (recompute, offload, a chunked
    head); optimizer: the optimizer step over 1/s of the state; exposed_communication: see [Note:
    Pricing communication]. Also, not summed: host and device, the kept step's host and device
    seconds (hooks included), to show which bounds it."""
    profile, s = plan.profile, layout.shard_size
    w = layout.world_size
    whole_opt = device.ops_time(opt_costs)
    hooks = device.shard_hooks(len(profile.blocks) + 1, params) if w > 1 else 0.0
    host, dev = profile.step_split
    if device.overlapped and host + dev > 0:
        compute = max(host + hooks, dev)
    else:
        compute = max(profile.step_time - whole_opt, 0.0) + hooks
    units = _units(plan, compute)
    reshard = layout.reshard_after_forward
    tiers = plan.tiers.extra_time if plan.tiers is not None else 0.0
    comm = {k: 0.0 for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")}
    comm |= {"communication": 0.0, "exposed_communication": 0.0, "collectives": 0.0}
    if w > 1:
        last = micro_batch_comm(units, w, s, reshard, True, device)
        other = micro_batch_comm(units, w, s, reshard, False, device)
        comm = {k: last[k] + (accumulation - 1) * other[k] for k in last}
    t = {
        "compute": accumulation * compute,
        # the tiers' time once a step (the state moves and steps once), the rest per micro-batch
        "recompute": accumulation * (plan.predicted_overhead - tiers) + tiers,
        "optimizer": device.ops_time([_scaled(c, s) for c in opt_costs]) if s > 1 else whole_opt,
        **comm,
    }
    t["step"] = sum(t[k] for k in _TERMS)
    opt = [_scaled(c, s) for c in opt_costs] if s > 1 else opt_costs
    opt_host, opt_dev = device.split(opt)
    t["host"] = accumulation * (host + hooks) + opt_host
    t["device"] = accumulation * dev + opt_dev
    return t


def _units(plan: Plan, compute: float) -> Units:
    """The units' bytes and compute for [Note: Pricing communication]: a block's backward is 2x
    its priced forward plus its recompute; the root has what is left of ``compute`` (a third
    forward, two thirds backward) and a chunked head's extra time in backward."""
    profile = plan.profile
    blocks = profile.blocks
    forward = [b.forward_time for b in blocks]
    extra = [b.extra_time[plan.decisions[b.path]] for b in blocks]
    root = max(compute - 3 * sum(forward), 0.0)
    head = profile.head_chunked_time if plan.head == "chunked" else 0.0
    return Units(
        root_params=profile.param_bytes - profile.buffer_bytes - sum(b.param_bytes for b in blocks),
        root_grads=profile.grad_rest_bytes * profile.reduce_scale,  # reduced in the reduce dtype
        block_params=[b.param_bytes for b in blocks],
        block_grads=[b.grad_bytes * profile.reduce_scale for b in blocks],
        root_forward=root / 3,
        root_backward=2 * root / 3 + head,
        block_forward=forward,
        block_backward=[2 * f + e for f, e in zip(forward, extra)],
    )


def _scaled(cost: OpCost, s: int) -> OpCost:
    """An optimizer op over 1/s of the state (its dispatch unchanged)."""
    return dataclasses.replace(
        cost,
        flops=cost.flops // s,
        bytes=cost.bytes // s,
        elements=cost.elements // s,
        largest_output=cost.largest_output // s,
    )


def optimizer_costs(model: nn.Module, optimizer: str, foreach: bool | None = None) -> list[OpCost]:
    """The ops of one optimizer step over ``model``'s trainable parameters (its state created
    by a step before), on fake tensors: what it costs does not depend on the micro-batch.
    ``foreach``: the implementation the target runs (``Target.foreach``: CUDA's foreach for a
    CUDA profile, [Note: The target's op stream]); None: the host's default."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        skeleton = _fake_copy(model, "cpu")
        for p in skeleton.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt = _make_optimizer(optimizer, skeleton, foreach)
        opt.step()
        with CostRecorder() as recorder:
            opt.step()
    return recorder.costs


def _choose(priced, budget, global_batch, tokens, device, skipped) -> AutoConfig:
    fits = sorted((c for c in priced if c.fits), key=lambda c: (-c.tokens_per_second, c.peak))
    if not fits:
        least = min(priced, key=lambda c: c.peak)
        raise PlanError(
            f"memfit.autoconfigure: no configuration fits {format_bytes(budget)} per rank. The smallest budget that "
            f"fits is {format_bytes(least.peak, up=True)}, at micro-batch {least.micro_batch} "
            f"({least.layout.describe()}). Use more ranks, a larger budget or a shorter sequence."
        )
    best = fits[0]
    ranked = [best, *(_lost_on_time(c, best) for c in fits[1:])]
    ranked += [
        dataclasses.replace(c, lost=f"memory: needs {format_bytes(c.peak, up=True)} or more per rank")
        for c in sorted((c for c in priced if not c.fits), key=lambda c: c.peak)
    ]
    return AutoConfig(best, tuple(ranked), budget, global_batch, tokens, device, skipped)


def _lost_on_time(c: Candidate, best: Candidate) -> Candidate:
    """Why ``c`` is slower than ``best``: by how much, and the term that grew most."""
    slower = 1 - c.tokens_per_second / best.tokens_per_second
    # per sample, so that configurations of different global batches compare
    per = {k: c.time[k] / c.samples - best.time[k] / best.samples for k in _TERMS}
    term = max(per, key=per.__getitem__)
    delta = per[term] * c.samples
    if slower <= 1e-9:
        return dataclasses.replace(c, lost=f"time: as fast, at a larger peak than {format_bytes(best.peak)}")
    why = f"{term.replace('_', ' ')} +{_ms(delta)}" if per[term] > 0 else "fewer samples a step"
    return dataclasses.replace(c, lost=f"time: {slower:.1%} fewer tokens/s ({why})")


def _ms(seconds: float) -> str:
    """Seconds as milliseconds to 3 significant digits (microseconds of communication show)."""
    return f"{seconds * 1e3:.3g} ms"


def micro_batch_sizes(world_size: int, global_batch: int | None, given: list[int] | None, largest: int) -> list[int]:
    """The micro-batch sizes autoconfigure tries (see its ``micro_batches``)."""
    if world_size < 1:
        raise ValueError(f"memfit.autoconfigure: world_size must be >= 1, got {world_size}")
    if global_batch is None:
        return sorted(set(given)) if given else [2**k for k in range(largest.bit_length()) if 2**k <= largest]
    if global_batch < world_size or global_batch % world_size:
        raise ValueError(
            f"memfit.autoconfigure: global_batch {global_batch} is not a multiple of world_size {world_size}: each "
            "rank takes global_batch / world_size samples a step; pass a multiple"
        )
    per_rank = global_batch // world_size
    if given and (bad := [b for b in given if b < 1 or per_rank % b]):
        raise ValueError(
            f"memfit.autoconfigure: micro_batches {bad} do not divide the {per_rank} samples a rank takes a step "
            f"(global_batch {global_batch} / world_size {world_size})"
        )
    return sorted(set(given)) if given else sorted({b for b in _divisors(per_rank) if b & (b - 1) == 0} | {per_rank})


def _layouts(world_size: int, shard_sizes: list[int] | None) -> list[Layout]:
    if world_size == 1:
        return [Layout(1)]
    sizes = shard_sizes or _divisors(world_size)
    out = []
    for s in sorted(set(sizes)):
        out += [Layout(world_size, s)] if s == 1 else [Layout(world_size, s), Layout(world_size, s, False)]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _first_tensor(batch: Inputs) -> torch.Tensor:
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise ValueError("memfit.autoconfigure: the example batch has no tensor with a batch dimension")
    return tensors[0]


def _batch_size(batch: Inputs) -> int:
    return _first_tensor(batch).shape[0]


def _resize(batch: Inputs, first: int, size: int) -> Inputs:
    """``batch`` with ``size`` samples: its rows repeated in turn (the batch's own values)."""
    if size == first:
        return batch

    def resize(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == first:
            return t[torch.arange(size, device=t.device) % first]
        return t

    return tree_map(resize, batch)


__all__ = [
    "AutoConfig",
    "Candidate",
    "Layout",
    "Search",
    "autoconfigure",
    "held_gradients",
    "micro_batch_sizes",
    "optimizer_costs",
    "step_terms",
]
