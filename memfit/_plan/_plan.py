"""`memfit.plan`: fit a training step into a memory budget at the least extra time."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit._checkpoint import Decision, Offload, remove_checkpointing
from memfit._plan._batch import check_batch
from memfit._plan._budget import describe_bytes, format_bytes, parse_bytes
from memfit._plan._calibrate import check_ranks
from memfit._plan._calibrate import device_profile as _device_profile
from memfit._plan._head import chunk_head, unchunk_head
from memfit._plan._profile import DECISIONS, profile_model
from memfit._plan._profile_types import ModelProfile, block_names
from memfit._plan._solve import Sharding, forecast, smallest_budget, solve, state_offload, timeline
from memfit._plan._step import Inputs, _make_optimizer, step_loss
from memfit._plan._tiers import TierChoice, Tiers, choose_tiers, tiers_of
from memfit._plan._time import DeviceProfile
from memfit._shard._mixed import MixedPrecision
from memfit.memory import MemoryMeter

_TERMS = {
    "state": "parameters and optimizer state (sharded: 1/shards each), buffers (whole on every rank)",
    "before_blocks": "the batch and what the embeddings keep for backward",
    "between_blocks": "what the code between the blocks holds since (an encoder's output, a decoder's masks)",
    "forward_transient": "the code before the block (embeddings, masks, positions): its temporaries",
    "backward_outside": "what the step holds in the block's backward outside the blocks (the loss, labels)",
    "grad_rest": "gradients of the parameters outside the blocks (sharded: 1/shards)",
    "last_output": "the last block's output",
    "head_transient": "the head, the loss and their backward (logits and their gradient)",
    "optimizer_peak": "the optimizer step's peak: parameters, gradients, state, temporaries (1/shards)",
    "tail_transient": "the backward before the blocks (embeddings): gradients outside the blocks, temporaries",
    "gather_buffers": "sharded or mixed: the root's full parameters (outside the blocks), from forward to backward",
    "unit_buffers": "sharded, in backward: two blocks' full parameters (the one computing, the one prefetched)",
    "kept_activations": "what the blocks keep for backward (in a block's backward: the blocks before it)",
    "held_inputs": "inputs checkpointed blocks hold that keeping every block would have freed (positions, masks)",
    "offload_stash": "offload on a device: the last two offloaded blocks' inputs, held until their copies are done",
    "gradients": "gradients alive at this moment (sharded: 1/shards, the block in flight whole)",
    "block_forward": "the forward of the block computing: its input, temporaries, what it keeps, its output",
    "block_backward": "the backward of the block computing: its recompute, its kept tensors' gradients",
    "root_reduce": "sharded: the root's whole gradients and their send buffer, reduce-scattered last",
    "bookkeeping": "sharded: 1 KiB per unit of reduce bookkeeping",
    "leftover": "what the forward leaves alive after backward (cached masks)",
    "workspace": "CUDA: the allocator's memory beside the tensors (cuBLAS workspaces); 0 on a CPU",
}
_LEGEND = (
    "kept: the activations a block keeps for backward under its decision; saved: kept less than keeping "
    "them all; extra ms: the recompute (or offload) time its decision adds to a step"
)


class PlanError(ValueError):
    """No plan fits the budget; the message gives the smallest budget that does."""


@dataclass
class Plan:
    """Per-block decisions with their forecast. Decisions: keep (store activations),
    selective (checkpoint, keep the Linear outputs), full (checkpoint), offload (checkpoint,
    the block input to disk)."""

    budget: int | None  # bytes; None for a fixed strategy (Plan.fixed)
    decisions: dict[str, str]  # block path -> decision kind (see Plan.decision)
    profile: ModelProfile
    sharding: Sharding | None
    rule: str = "linear"
    offload: Offload | None = None
    solve_seconds: float = 0.0
    head: str = "plain"  # the LM head and loss: "plain" or "chunked" (see [Note: The head as a decision])
    forecast: dict[str, float] = field(default_factory=dict)
    tiers: TierChoice | None = None  # where the model state lives (See [Note: Planned tiers])

    def __post_init__(self) -> None:
        if self.head not in ("plain", "chunked") or (self.head == "chunked" and self.profile.head_chunked is None):
            raise ValueError(f"memfit.Plan: head {self.head!r}: 'plain', or 'chunked' for a profile with an LM head")
        self.forecast = _forecast(
            self.profile, [self.decisions[b.path] for b in self.profile.blocks], self.sharding, self.head
        )
        if self.tiers is not None:  # the state off the device: its peak less, its step longer
            self.forecast["peak"] -= self.tiers.device_saved
            self.forecast["extra_time"] += self.tiers.extra_time
            self.forecast["step_time"] += self.tiers.extra_time

    @classmethod
    def fixed(
        cls, decisions: dict[str, str], profile: ModelProfile, sharding: Sharding | None = None, *, head: str = "plain"
    ) -> Plan:
        """A strategy chosen by hand, not solved for a budget: ``decisions`` maps every block of
        ``profile`` to a kind. Its forecast, ``apply`` and ``measure`` work as for a solved plan."""
        missing = [b.path for b in profile.blocks if b.path not in decisions]
        if missing:
            raise ValueError(f"memfit.Plan.fixed: no decision for blocks {missing}")
        for b in profile.blocks:
            if decisions[b.path] in b.unavailable:
                raise ValueError(
                    f"memfit.Plan.fixed: {b.path} cannot take {decisions[b.path]!r} "
                    f"({b.unavailable[decisions[b.path]]}); choose another decision for it"
                )
        return cls(budget=None, decisions=dict(decisions), profile=profile, sharding=sharding, head=head)

    @property
    def predicted_peak(self) -> int:
        return int(self.forecast["peak"])

    @property
    def predicted_overhead(self) -> float:
        """Seconds added to a step by recompute and offload."""
        return self.forecast["extra_time"]

    @property
    def predicted_step_time(self) -> float:
        """Seconds of a whole step under this plan on the profile's device (priced, not timed)."""
        return self.forecast["step_time"]

    def apply(self, model: nn.Module) -> nn.Module:
        """Checkpoint ``model``'s blocks in place as decided (blocks to keep are left plain); with
        a chunked head, ``model(**batch)`` computes its loss chunked and returns only ``.loss``."""
        for path, kind in self.decisions.items():
            self.decision(kind).apply(model.get_submodule(path), name=path)
        if self.head == "chunked":
            assert self.profile.head is not None  # a chunked head is chosen only for a profiled head
            chunk_head(model, self.profile.head)
        return model

    def unapply(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`: every block plain again and the head whole (``model(**batch)``
        returns logits again, for evaluation or ``generate()``)."""
        for path in self.decisions:
            remove_checkpointing(model.get_submodule(path))
        unchunk_head(model)
        return model

    def decision(self, kind: str) -> Decision:
        """The :class:`memfit.Decision` this plan means by ``kind`` (its rule and offload)."""
        return Decision.parse(kind, save=self.rule, offload=self.offload)

    def table(self) -> str:
        """Per block (runs of 3 or more identical rows as one): decision, bytes kept and saved
        against keeping, extra time; then the verdict and the forecast's per-rank terms."""
        rows: list[tuple] = []
        for b, name in zip(self.profile.blocks, block_names(self.profile)):
            d = self.decisions[b.path]
            key = (d, b.kept[d], b.kept["keep"], b.extra_time[d])
            if rows and rows[-1][0] == key:
                rows[-1][1].append(name)
            else:
                rows.append((key, [name]))
        labels = [ps[0] if len(ps) < 3 else f"{ps[0]} ..{ps[-1].rsplit('.', 1)[-1]} ({len(ps)})" for _, ps in rows]
        width = max(32, *(len(label) + 2 for label in labels))
        lines = [f"{'block':<{width}}{'decision':<11}{'kept':>12}{'saved':>12}{'extra ms':>10}"]
        for label, ((d, kept, keep, extra), paths) in zip(labels, rows):
            for path in paths if len(paths) < 3 else [label]:
                lines.append(
                    f"{path:<{width}}{d:<11}{format_bytes(kept):>12}{format_bytes(keep - kept):>12}{extra * 1e3:>10.1f}"
                )
        tiers = [f"Tiers: {self.tiers.line()}"] if self.tiers is not None else []
        verdict = [*self._verdict(), *tiers, *self._terms(), *self._levers()]
        return "\n".join([*lines, _LEGEND, *self._unavailable(), "", *verdict])

    def _unavailable(self) -> list[str]:
        """A line per decision some blocks cannot take ([Note: A decision a block cannot take])."""
        lines = []
        for d in self._allowed():
            blocks = [b for b in self.profile.blocks if d in b.unavailable]
            if blocks:
                lines.append(f"{d} is not available on {', '.join(b.path for b in blocks)}: {blocks[0].unavailable[d]}")
        return lines

    def _verdict(self) -> list[str]:
        f, shard = self.forecast, self.sharding
        floors = {h: smallest_budget(p, shard, self._allowed()) for h, p in _head_variants(self.profile, None).items()}
        floor = min(floors.values())
        keep_all = _forecast(self.profile, ["keep"] * len(self.profile.blocks), shard, self.head)["peak"]
        where = f"per rank ({shard.describe()})" if shard and shard.world_size > 1 else "in one process"
        if self.profile.compute:  # mixed precision: [Note: Forecasts under mixed precision]
            masters = format_bytes(self.profile.master_bytes)
            where += f" under mixed precision ({self.profile.compute}; {masters} of master weights)"
        if self.budget is None:
            head = f"fixed strategy (no budget): predicted peak {format_bytes(f['peak'])} {where} at {f['at']}"
        else:
            verdict = "fits" if f["peak"] <= self.budget else "does not fit"
            head = (
                f"budget {describe_bytes(self.budget)} {where}: {verdict}, predicted peak {format_bytes(f['peak'])} "
                f"at {f['at']} ({format_bytes(self.budget - f['peak'])} to spare)"
            )
        source = f" ({self.profile.device_source})" if self.profile.device_source else ""
        chunked = self.head == "chunked"
        return [
            head,
            *self._head_line(),
            f"smallest budget any plan fits: {format_bytes(floor, up=True)}{_whole_head(floors)}; keeping every "
            f"activation: {format_bytes(keep_all, up=True)}{' (head and loss chunked, as planned)' * chunked}",
            f"what to change: {self._change(keep_all)}",
            f"time on {self.profile.device or 'the device profile'}{source}: predicted step "
            f"{f['step_time'] * 1e3:.1f} ms, of which recompute and offload {f['extra_time'] * 1e3:.1f} ms "
            f"(solved in {self.solve_seconds * 1e3:.0f} ms)",
        ]

    def _head_line(self) -> list[str]:
        p = self.profile
        if p.head_chunked is None:
            return []
        if p.head_transient <= p.head_chunked and self.head == "plain":
            return ["head and loss: plain (chunking them would save nothing here)"]
        saved = format_bytes(p.head_transient - p.head_chunked)
        cost = f"{p.head_chunked_time * 1e3:.1f} ms"
        if self.head == "chunked":
            return [f"head and loss: chunked (memfit.chunked_cross_entropy), {saved} of logits saved for {cost}"]
        return [f"head and loss: plain (chunking them would save {saved} for {cost})"]

    def _allowed(self) -> tuple[str, ...]:
        return tuple(d for d in DECISIONS if any(d in b.kept or d in b.unavailable for b in self.profile.blocks))

    def _change(self, keep_all: float) -> str:
        """What would let every activation be kept: more memory (per rank when sharded), or
        sharding over more ranks when that alone would do it."""
        if self.budget is not None and keep_all <= self.budget:
            return "nothing: every activation is kept (no recompute)"
        shard = self.sharding if self.sharding and self.sharding.world_size > 1 else None
        more = format_bytes(keep_all - (self.budget if self.budget is not None else self.forecast["peak"]), up=True)
        text = f"{more} more {'per rank' if shard else 'memory'} keeps every activation (no recompute)"
        if self.forecast["extra_time"] > 0:
            text += f", {self.forecast['extra_time'] * 1e3:.1f} ms a step faster"
        if self.budget is not None and (wider := _wider_sharding(self.profile, shard, self.budget)):
            text += f", or {wider.describe()} ({_shard_advice(shard, wider)}) keeps them within the budget"
        return text

    def _terms(self) -> list[str]:
        """The parts the peak's moment adds up (they sum to the peak), then the terms that
        belong to other moments (not in the sum)."""
        f = self.forecast
        parts = [(k.removeprefix("part:"), v) for k, v in f.items() if k.startswith("part:") and v]
        rank = " per rank" if self.sharding else ""
        lines = [f"the peak{rank}, {format_bytes(f['peak'])} at {f['at']}, is the sum of:"]
        lines += [f"  {k:<18}{format_bytes(v):>12}  {_TERMS.get(k, '')}" for k, v in parts]
        lines.append(f"  {'= peak':<18}{format_bytes(sum(v for _, v in parts)):>12}")
        others = [
            f"{name} {format_bytes(v)}"
            for k, v in f.items()
            if k.startswith("term:") and v and (name := k.removeprefix("term:")) not in dict(parts)
        ]
        if others:
            lines.append(f"other moments' terms (not in the sum): {', '.join(others)}")
        return lines

    def _levers(self) -> list[str]:
        """Every way to lower the peak the forecast prices, cheapest first: step time added per
        GiB the predicted peak drops, against keeping every activation with the head plain."""
        p, shard = self.profile, self.sharding
        keep = ["keep"] * len(p.blocks)
        base = _forecast(p, keep, shard, "plain")["peak"]
        levers = [
            (
                f"{kind} on every block",
                base - (f := _forecast(p, [kind] * len(p.blocks), shard, "plain"))["peak"],
                f["extra_time"],
            )
            for kind in self._allowed()
            if kind != "keep" and all(kind in b.kept for b in p.blocks)
        ]
        if p.head_chunked is not None:
            levers.append(
                ("chunk the head and loss", base - _forecast(p, keep, shard, "chunked")["peak"], p.head_chunked_time)
            )
        if shard and shard.shards > 1:
            saved, seconds = state_offload(p, shard)
            levers.append(("model state offload (memfit.shard(offload='cpu'))", saved, seconds))
        useful = sorted((lever for lever in levers if lever[1] > 0), key=lambda lever: lever[2] / lever[1])
        if not levers:
            return []
        whole = " with the head and loss whole" if self.head == "chunked" else ""  # the verdict's is chunked
        lines = [
            "levers that lower the peak, cheapest first (ms added a step per GiB off the keep-everything "
            f"peak{whole}, {format_bytes(base, up=True)}):"
        ]
        width = max(len(name) for name, _, _ in levers) + 2
        for name, saved, seconds in useful:
            lines.append(
                f"  {name:<{width}}saves {format_bytes(saved):>11} for {seconds * 1e3:>9.1f} ms"
                f"  = {seconds * 1e3 / (saved / 2**30):>9.1f} ms/GiB"
            )
        if useless := [name for name, saved, _ in levers if saved <= 0]:
            at = _forecast(p, keep, shard, "plain")["at"]
            lines.append(f"  not lowering the peak (set at {at}): {', '.join(useless)}")
        return lines

    def timeline(self) -> list[dict]:
        """The step's moments in order (after each block's forward; end of forward; each block's
        backward; the embeddings' backward; the end of backward when sharded; the optimizer step),
        each ``{"moment", "parts", "total"}``: the named bytes per rank the forecast adds up there.
        The largest total is :attr:`predicted_peak` (with a chunked head, that of the chunked head)."""
        profile = _head_variants(self.profile, True)["chunked"] if self.head == "chunked" else self.profile
        return timeline(profile, [self.decisions[b.path] for b in profile.blocks], self.sharding)

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "world_size": self.sharding.world_size if self.sharding else 1,
            "shard_size": self.sharding.shards if self.sharding else 1,
            "decisions": dict(self.decisions),
            "predicted_peak": self.predicted_peak,
            "predicted_overhead_s": self.predicted_overhead,
            "predicted_step_time_s": self.predicted_step_time,
            "head": self.head,
            "device_profile": self.profile.device,
            "device_profile_source": self.profile.device_source,
            "peak_at": self.forecast["at"],
            "terms": {k.removeprefix("term:"): v for k, v in self.forecast.items() if k.startswith("term:")},
            "kept_activations": self.forecast["kept_activations"],
            "blocks": [
                {"path": b.path, "kept": b.kept, "peak": b.peak, "extra_time_s": b.extra_time}
                for b in self.profile.blocks
            ],
            "timeline": self.timeline(),
            **({"tiers": self.tiers.to_dict()} if self.tiers is not None else {}),
        }

    def measure(
        self,
        model: nn.Module,
        example_inputs: Inputs,
        *,
        loss_fn: Callable | None = None,
        optimizer: str = "adamw",
        steps: int = 2,
    ) -> int:
        """Train a copy of ``model`` under this plan and return the peak of its last step
        (MemoryMeter; after the first step the optimizer state exists, as in the forecast)."""
        model = self.apply(copy.deepcopy(model))
        model.train()
        opt = _make_optimizer(optimizer, model)
        for _ in range(steps):
            with MemoryMeter(model=model, optimizer=opt) as meter:
                step_loss(model, example_inputs, loss_fn).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return meter.peak_bytes

    def compare(self, measured_peak: int | MemoryMeter) -> str:
        """Predicted against measured peak (bytes, or a MemoryMeter around a step). The forecast
        is of a step whose optimizer state exists already: measure the second step or a later
        one (the first step's peak comes before AdamW's state is created)."""
        measured = measured_peak.peak_bytes if isinstance(measured_peak, MemoryMeter) else measured_peak
        ratio = self.predicted_peak / measured
        text = (
            f"predicted peak {format_bytes(self.predicted_peak)}, measured {format_bytes(measured)} "
            f"({ratio:.3f}x, error {abs(ratio - 1):.1%})"
        )
        if self.budget is None:
            return text
        fits = "fits" if measured <= self.budget else "exceeds"
        return f"{text}; the measured step {fits} the budget {format_bytes(self.budget)}"

    def _budget_text(self) -> str:
        return "fixed strategy (no budget)" if self.budget is None else f"budget {format_bytes(self.budget)}"

    def __repr__(self) -> str:
        counts = {d: list(self.decisions.values()).count(d) for d in DECISIONS}
        budget = "None" if self.budget is None else format_bytes(self.budget)
        return f"Plan(budget={budget}, peak={format_bytes(self.predicted_peak)}, {counts})"


def replicas_forecast(mixed_precision: MixedPrecision | None, profile: ModelProfile | None = None) -> bool:
    """Whether a replicated layout (memfit's units over a (W, 1) mesh) is forecast under mixed
    precision: where gradients are summed in fp32, as they were measured (See [Note:
    Forecasts under mixed precision]); ``profile``: a mixed-precision profile, when no policy is given."""
    if mixed_precision is not None:
        return mixed_precision.reduce_dtype == torch.float32
    return profile is not None and profile.reduce_scale >= profile.grad_shard_scale


def plan(
    model: nn.Module,
    example_inputs: Inputs,
    *,
    budget: int | float | str,
    loss_fn: Callable | None = None,
    world_size: int = 1,
    shard_size: int | None = None,
    sharding: bool | None = None,
    optimizer: str = "adamw",
    candidates: list[str] | None = None,
    decisions: tuple[str, ...] = DECISIONS,
    profile: ModelProfile | None = None,
    device_profile: str | DeviceProfile | None = None,
    offload: str | Offload | None = None,
    chunk_head: bool | None = None,
    mixed_precision: MixedPrecision | None = None,
    host_budget: int | float | str | None = None,
    disk: str | None = None,
    disk_budget: int | float | str | None = None,
    disk_bandwidth: float | None = None,
    max_norm: float | None = None,
    accumulate: int = 1,
    overlap: bool = True,
    no_sync: bool = False,
) -> Plan:
    """Profile ``model``'s blocks on ``example_inputs`` and choose, per block, keep / selective
    / full checkpoint / offload so the step's predicted peak fits ``budget`` at the least
    predicted extra time. The forecast is a sum of named terms (parameters, buffers and
    optimizer state; what exists before the blocks; kept activations; the head and loss; the
    gradients; the optimizer step); ``Plan.table()`` shows them. The step runs on fake tensors
    ([Note: Planning on fake tensors]) and times are priced from operation counts ([Note: The
    planner's time model]): the same model, batch and budget give the same plan.

    Args:
        model: not modified; it may be on the meta device (profiling works on a skeleton of
            fake tensors, never a copy of its memory).
        example_inputs: one batch: a dict (keyword arguments), a tuple or list (positional
            arguments) or a tensor (the one argument).
        loss_fn: ``loss_fn(output) -> scalar loss``; by default the output's ``.loss`` (or
            ``["loss"]``), or the output itself when a scalar (else ValueError).
        budget: bytes, or a string such as ``"6GB"``, ``"3.5GiB"``, ``"800MB"``.
        world_size, sharding: forecast per rank for a model sharded over ``world_size`` ranks
            (sharding defaults to ``world_size > 1``; see [Note: Sharded forecasts]).
        shard_size: hybrid sharding (HSDP): sharded over groups of this many ranks, replicated
            ``world_size // shard_size`` times (default: all ranks).
        optimizer: "adamw", "adam" or "sgd" (its state and step are measured).
        candidates: module paths of the blocks to decide for, each one that runs on the
            batch (default: the layers that run, whatever their classes; see [Note: Default
            candidates]). The rest is measured as a whole.
        decisions: the decisions allowed.
        profile: a profile from an earlier call (``plan.profile``), to re-plan without measuring.
        device_profile: what time is priced on: "h100", "h200", "a100", "cpu", "calibrated"
            (this machine, by ``memfit calibrate``, cached) or a :class:`memfit.DeviceProfile`;
            None: the named one of the model's device ("cpu" for the meta device; never the
            cache: see [Note: The default device profile]).
        chunk_head: chunk a transformers LM's head and loss (memfit.chunked_cross_entropy;
            labels= given, no loss_fn): None when that fits at less extra time, True always,
            False never. See [Note: The head as a decision].
        offload: where "offload" puts a block's input: "cpu" (host memory; the default for a
            model planned for an accelerator), "disk" (the default on a CPU, where host memory
            is the memory being saved) or a :class:`memfit.Offload`.
        mixed_precision: the :class:`memfit.MixedPrecision` the model will be sharded with
            (memfit.shard / FullyShardedDataParallel / fully_shard): the step is measured as its
            units compute (bf16 copies, activations and gradients beside fp32 shards and
            optimizer state) and priced at the compute dtype's rate, at any world size. See
            [Note: Forecasts under mixed precision].
        host_budget, disk, disk_budget, disk_bandwidth: plan the tiers of the model state too
            (any given): host memory per rank, a directory on a local disk with its bytes (default:
            its free space) and bytes/s; the plan's ``tiers`` says where the state lives (device,
            host memory, which blocks on disk) and what each tier holds and moves a step
            (memfit.shard(offload="cpu"), memfit.host_optimizer(disk=, disk_modules=) apply it).
            See [Note: Planned tiers].
        max_norm, accumulate, overlap: memfit.host_optimizer's, which the tiers will step
            under, and ``no_sync``: the backwards before the last run in ``model.no_sync()``.
            The disk tier's bytes a step are those of the path its step takes (a clip and
            ``overlap=False`` step after backward; each micro-batch moves the shards).

    Raises:
        PlanError: no plan fits; the message gives the smallest budget that does.
        ValueError: the batch cannot run through the model (sequence longer than its learned
            positions, token ids or labels outside its vocabulary, ids not an integer
            [batch, seq] tensor), naming the argument and the limit.
    """
    budget_bytes = parse_bytes(budget)
    if (bad := [d for d in decisions if d not in DECISIONS]) or not decisions:
        raise ValueError(f"memfit.plan: unknown decisions {bad}; choose from {DECISIONS}")
    shard = _sharding(world_size, shard_size, sharding)
    if profile is not None and mixed_precision is not None and not profile.master_bytes:
        raise ValueError(
            "memfit.plan: mixed_precision= with a profile measured without it; profile again (drop profile=)"
        )
    mixed = mixed_precision is not None or bool(profile is not None and profile.master_bytes)
    replicated = world_size > 1 and (shard is None or shard.shards == 1)
    if mixed and replicated and not replicas_forecast(mixed_precision, profile):
        raise ValueError(
            f"memfit.plan: mixed precision over {world_size} replicas of one shard is forecast with "
            "reduce_dtype=torch.float32 only (the micro-batches' gradients accumulate in fp32; see [Note: Forecasts "
            "under mixed precision]); pass it, or shard the model: shard_size > 1, or the default (all ranks)"
        )
    device = _device_profile(device_profile, _device_type(model))
    check_ranks(device, world_size, "memfit.plan")
    opts: dict[str, Any] = {"decisions": decisions, "device": device}
    if profile is None:
        check_batch(model, example_inputs)  # See [Note: Checking the batch before planning]
        blocks = [(p, model.get_submodule(p)) for p in candidates] if candidates is not None else None
        opts["chunk_head"] = chunk_head is not False
        opts["mixed_precision"] = mixed_precision
        profile = profile_model(model, example_inputs, blocks, loss_fn=loss_fn, optimizer=optimizer, **opts)
    if missing := sorted({d for b in profile.blocks for d in decisions if d not in b.kept and d not in b.unavailable}):
        raise ValueError(f"memfit.plan: the profile given has no measurements for {missing}; profile again")
    if stuck := [b for b in profile.blocks if not any(d in b.kept for d in decisions)]:
        why = "; ".join(f"{b.path}: {b.unavailable}" for b in stuck[:3])
        raise ValueError(
            f"memfit.plan: {len(stuck)} blocks can take none of the decisions {list(decisions)} ({why}); "
            "allow 'keep' or another decision"
        )
    offload = offload or ("disk" if device.name in ("cpu", "calibrated-cpu") else "cpu")
    t0 = time.perf_counter()
    tiers = tiers_of(host_budget, disk, disk_budget, disk_bandwidth, max_norm, accumulate, overlap, no_sync)
    tier, head, chosen = _solve_tiers(profile, budget_bytes, shard, decisions, chunk_head, tiers, device.name)
    return Plan(
        budget=budget_bytes,
        decisions={b.path: d for b, d in zip(profile.blocks, chosen)},
        profile=profile,
        sharding=shard,
        offload=Offload(offload) if isinstance(offload, str) else offload,
        solve_seconds=time.perf_counter() - t0,
        head=head,
        tiers=tier,
    )


def _solve_tiers(
    profile: ModelProfile, budget: int, shard: Sharding | None, decisions, chunk_head, tiers: Tiers | None, device: str
) -> tuple[TierChoice | None, str, list[str]]:
    """The tiers (None: not asked), the head and the blocks' decisions."""
    if tiers is None:
        return (None, *_solve_with_heads(profile, budget, shard, decisions, chunk_head))
    accelerator = device not in ("cpu", "calibrated-cpu")
    tier, (head, chosen) = choose_tiers(
        profile, shard, tiers, accelerator, lambda freed: _solved(profile, budget + freed, shard, decisions, chunk_head)
    )
    return tier, head, chosen


def _solved(profile: ModelProfile, budget: int, shard: Sharding | None, decisions, chunk_head: bool | None):
    """(extra seconds, (head, decisions)) of the device's plan at ``budget``; None: none fits."""
    try:
        head, chosen = _solve_with_heads(profile, budget, shard, decisions, chunk_head)
    except PlanError:
        return None
    return _forecast(profile, chosen, shard, head)["extra_time"], (head, chosen)


def _sharding(world_size: int, shard_size: int | None, sharding: bool | None) -> Sharding | None:
    """The layout forecasts are per rank of (None: one unsharded process)."""
    layout = Sharding(world_size, shard_size)  # checked even when not sharded (world_size 0, shard_size 8 of 1)
    if sharding is False and shard_size is not None:
        raise ValueError(
            f"memfit.plan: shard_size={shard_size} with sharding=False; hybrid sharding shards over "
            "groups of shard_size ranks: drop sharding=False, or drop shard_size to forecast unsharded ranks"
        )
    return layout if (sharding if sharding is not None else world_size > 1) else None


def _solve_with_heads(
    profile: ModelProfile, budget: int, shard: Sharding | None, decisions, chunk_head: bool | None
) -> tuple[str, list[str]]:
    """The head and block decisions of least extra time that fit, over the heads allowed."""
    if chunk_head and profile.head_chunked is None:
        raise ValueError(
            "memfit.plan: chunk_head=True needs a transformers masked or causal LM called with labels= and no loss_fn"
        )
    best = None  # (extra seconds, head, decisions)
    for head, variant in _head_variants(profile, chunk_head).items():
        chosen = solve(variant, budget, shard, decisions)
        if chosen is not None:
            extra = forecast(variant, chosen, shard)["extra_time"]
            extra += profile.head_chunked_time if head == "chunked" else 0.0
            best = min(best, (extra, head, chosen)) if best else (extra, head, chosen)
    if best is None:
        least = min(_head_variants(profile, chunk_head).values(), key=lambda p: p.head_transient)
        raise _no_fit(least, budget, shard, decisions)
    return best[1], best[2]


def _whole_head(floors: Mapping[str, float]) -> str:
    """What the smallest budget of a chunked head leaves out: the one with the head whole (the
    loss `memfit train` computes), when it is larger."""
    if "chunked" not in floors or floors["chunked"] >= floors["plain"]:
        return ""
    return f" (with the head and loss chunked; {format_bytes(floors['plain'], up=True)} with them whole)"


def _head_variants(profile: ModelProfile, chunk_head: bool | None) -> dict[str, ModelProfile]:
    """The profile as each head allowed makes it: the chunked one with T_head chunked."""
    out = {} if chunk_head else {"plain": profile}
    if chunk_head is not False and profile.head_chunked is not None:
        out["chunked"] = dataclasses.replace(profile, head_transient=profile.head_chunked)
    return out


def _forecast(profile: ModelProfile, decisions: list[str], shard: Sharding | None, head: str) -> dict[str, float]:
    """``forecast`` with the head as decided: chunked, T_head chunked and its extra time added."""
    if head == "plain":
        return forecast(profile, decisions, shard)
    f = forecast(_head_variants(profile, True)["chunked"], decisions, shard)
    f["extra_time"] += profile.head_chunked_time
    f["step_time"] += profile.head_chunked_time
    return f


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None or first.device.type == "meta" else str(first.device)


def _wider_sharding(profile: ModelProfile, shard: Sharding | None, budget: int) -> Sharding | None:
    """The narrowest sharding up to 64x wider (more ranks; under HSDP a larger shard group on
    the same ranks) whose keep-everything forecast fits ``budget``, if there is one."""
    keep = ["keep"] * len(profile.blocks)
    if shard is not None and shard.shards < shard.world_size:
        sizes = [s for s in range(shard.shards + 1, shard.world_size + 1) if shard.world_size % s == 0]
        options = [Sharding(shard.world_size, s) for s in sizes]
    else:
        w = shard.world_size if shard else 1
        options = [Sharding(w * 2**k) for k in range(1, 7)]
    return next((o for o in options if forecast(profile, keep, o)["peak"] <= budget), None)


def _shard_advice(shard: Sharding | None, wider: Sharding) -> str:
    if shard is None:
        return "memfit.shard over that many processes"
    if wider.world_size == shard.world_size:
        return "a larger shard group on the same ranks"
    return "more ranks"


def _no_fit(profile: ModelProfile, budget_bytes: int, shard: Sharding | None, decisions) -> PlanError:
    floor = smallest_budget(profile, shard, decisions)
    least = forecast(profile, ["keep"] * len(profile.blocks), shard)
    per_rank = " per rank" if shard is not None and shard.world_size > 1 else ""
    return PlanError(
        f"memfit.plan: no plan fits {format_bytes(budget_bytes)}. The smallest budget that fits is "
        f"{format_bytes(floor, up=True)}; keeping every activation needs {format_bytes(least['peak'], up=True)}. "
        f"What no decision reduces{per_rank}: parameters, buffers and optimizer state "
        f"{format_bytes(least['term:state'])}, optimizer step peak {format_bytes(least['term:optimizer_peak'])}, "
        f"head and loss {format_bytes(least['term:head_transient'])}. {_no_fit_advice(shard)}"
    )


def _no_fit_advice(shard: Sharding | None) -> str:
    if shard is None or shard.world_size == 1:
        return "Use a smaller batch, or shard the model over several processes (memfit.shard; plan with world_size=N)."
    if shard.shards < shard.world_size:
        return "Use a smaller batch per rank, a larger shard_size, or more ranks."
    return "Use a smaller batch per rank, or shard over more ranks."
