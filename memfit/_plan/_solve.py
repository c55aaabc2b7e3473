"""Choose keep / selective / full / offload per block: least extra time under a byte budget."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit._checkpoint._decision import KINDS as DECISIONS
from memfit._checkpoint._decision import DecisionKind
from memfit._plan._profile_types import ModelProfile, block_names

BINS = 8192


@dataclass(frozen=True)
class Sharding:
    """Per-rank accounting when the model is sharded: over all ``world_size`` ranks (fully
    sharded, ZeRO-3), or over groups of ``shard_size`` ranks replicated ``world_size //
    shard_size`` times (hybrid sharding, HSDP). See [Note: Sharded forecasts]."""

    world_size: int
    shard_size: int | None = None  # ranks a unit is sharded over; None: world_size
    # False: blocks stay gathered from their forward to their backward (no second all-gather;
    # see [Note: Sharded forecasts])
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name, v in (("world_size", self.world_size), ("shard_size", self.shard_size)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"memfit.plan: {name} must be a whole number of ranks, got {v!r}")
        if self.world_size < 1:
            raise ValueError(f"memfit.plan: world_size must be >= 1, got {self.world_size}")
        s = self.shard_size
        if s is not None and (s < 1 or s > self.world_size or self.world_size % s):
            raise ValueError(
                f"memfit.plan: shard_size {s} must divide world_size {self.world_size} (hybrid sharding: "
                f"{self.world_size} ranks as replicas x shard groups); pass a divisor of {self.world_size}"
            )

    @property
    def shards(self) -> int:
        """Ranks the model state is divided over."""
        return self.shard_size or self.world_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.shards

    def describe(self) -> str:
        kept = "" if self.reshard_after_forward or self.shards == 1 else ", blocks gathered forward to backward"
        if self.shards == self.world_size:
            return f"world size {self.world_size}{kept}"
        return f"world size {self.world_size}: {self.replicas} replicas x {self.shards} shards{kept}"


# [Note: Sharded forecasts]
# Sharded over s ranks (s = world_size when fully sharded, shard_size under HSDP), a rank holds
# 1/s of the parameters, gradients and optimizer state; buffers are whole on every rank. Under
# HSDP the gradients are reduce-scattered in the shard group and the 1/s shard is then
# all-reduced across the replicas in place: nothing else stays alive, so per-rank memory
# depends on s only (the replicas change traffic, not bytes). A unit's full parameters are a
# buffer of its own beside the shard, the whole unit, not (1 - 1/s) of it (that under-forecast a
# 32k-vocabulary Llama by 12%), and they exist at different moments:
#   gather_buffers  the root's full parameters (everything outside the blocks): gathered when
#                   forward starts, kept until its backward ends -- every forward and backward
#                   moment;
#   unit_buffers    two blocks in full, the one computing and the one prefetched -- in the
#                   backward of a block. At the end of forward the last block has resharded
#                   and backward has not re-gathered it yet: counting them there over-forecast
#                   BERT, GPT-2 and Llama at W = 2 and 4 by 2 blocks' parameters (+3.5% to +5.3%).
# With reshard_after_forward=False a block is not freed after its forward: at the end of forward
# every block is whole (all blocks' parameters, on top of the root's), and in the backward of
# block i blocks 0..i still are (each is freed after its own backward; nothing is prefetched).
# Nothing is gathered at the optimizer step. One shard (s = 1) gathers nothing. The root's
# gradients (everything outside the blocks) are whole from the head's backward to the end of
# backward, where the root reduce-scatters them last: its parameters are freed by then, its
# gradients are copied into a send buffer as large and 1/s of it comes back -- the peak of a
# small Llama at W = 2 (a moment of its own, "end of backward"; an under-forecast without it).
# The runtime's holding rules ([Note: Streams and buffer lifetimes]) are the same on CUDA as on
# the CPU these terms were measured on, where each one is counted: a unit's full gradients go
# at its post-backward (own gradients, "gradients"); the send buffer and the 1/s shard of the
# block after stay until the next post-backward ("gradients": the shard; the send buffer is
# as large as the gradients of the block computing, which are not all made at its peak); in
# forward, CUDA holds the last all-gather output until the next all-gather, in place of the
# prefetched unit that unit_buffers counts, and frees it when the root's forward ends (no term
# at the end of forward); in backward it frees it at once.
# Bytes per unit a sharded step holds beside the tensors named above (its reduce's "has a
# gradient" flags and check sums, see memfit/_shard): 1.4 KB in all were measured at the end of
# backward of a 2-block Llama (3 units); 1 KiB per unit bounds them.
_BOOKKEEPING = 1024


def terms(profile: ModelProfile, sharding: Sharding | None) -> dict[str, float]:
    """The decision-independent terms, per rank (bytes)."""
    s = sharding.shards if sharding else 1
    t = {
        # parameters and optimizer state (sharded); buffers (replicated)
        "state": (profile.state_bytes - profile.buffer_bytes) / s + profile.buffer_bytes,
        "before_blocks": profile.before_blocks,
        "grad_rest": profile.grad_rest_bytes * profile.grad_shard_scale / s,
        # under mixed precision the loss's backward was measured holding a second copy of the
        # last block's output where that block is checkpointed (0.9993x to 0.9997x at full
        # without it, short by about that tensor): counted for every decision, an upper bound
        "last_output": profile.last_output * (2 if profile.master_bytes else 1),
        "head_transient": profile.head_transient,
        "optimizer_peak": profile.optimizer_peak / s,
        "tail_transient": profile.tail_transient,
        "gather_buffers": 0.0,
        "unit_buffers": 0.0,
        "workspace": float(profile.workspace_bytes),  # [Note: The allocator beside the tensors]
    }
    if gathered(profile, s):  # see [Note: Sharded forecasts]
        t["gather_buffers"] = profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
        t["unit_buffers"] = 2 * max(b.param_bytes for b in profile.blocks)
        if sharding is not None and not sharding.reshard_after_forward:  # every block, at the end of forward
            t["unit_buffers"] = sum(b.param_bytes for b in profile.blocks)
    return t


def gathered(profile: ModelProfile, shards: int) -> bool:
    """Whether units compute on copies of their parameters: sharded, or under mixed precision
    at any shard count (see [Note: Forecasts under mixed precision])."""
    return shards > 1 or bool(profile.master_bytes)


# [Note: Model-state offload, forecast only]
# memfit.shard(unit, offload="cpu") keeps a unit's shards, their gradients and so its optimizer
# state in host memory; the step gathers the shards onto the device, and sends the reduced
# gradients back. Per rank and per step, offloading every unit
#     saves  (parameters + optimizer state) / s + gradients / s   at every moment, and the
#            optimizer step leaves the device,
#     costs  (2 x parameters / s + gradients / s) / BW_offload    (shards up for forward and for
#            backward, gradient shards down) + the optimizer step on the host, 2 x (parameters
#            + gradients + state) / s / BW_host (read and written once at the "cpu" profile's
#            memory bandwidth).
# The planner reports it beside a sharded plan; the solver does not choose it (it chooses the
# activations' decisions only), and nothing here was measured on an accelerator.
def state_offload(profile: ModelProfile, sharding: Sharding) -> tuple[float, float]:
    """Bytes per rank offloading every unit's model state saves, and seconds it adds a step."""
    from memfit._plan._time import PROFILES

    s = sharding.shards
    params = profile.master_bytes or profile.param_bytes - profile.buffer_bytes  # the shards' dtype
    grads = (profile.grad_rest_bytes + sum(b.grad_bytes for b in profile.blocks)) * profile.grad_shard_scale
    saved = (params + profile.optimizer_bytes + grads) / s
    bandwidth = profile.offload_bandwidth or PROFILES["cpu"].offload_bandwidth
    host = 2 * (params + grads + profile.optimizer_bytes) / s / PROFILES["cpu"].memory_bandwidth
    return saved, (2 * params + grads) / s / bandwidth + host


@dataclass(frozen=True)
class _Moments:
    """The decision-independent part of every moment of [Note: The planner's memory model],
    per rank: what ``forecast`` adds up and what ``solve`` subtracts from the budget. Each
    moment's total is the sum of its named parts (``parts``), which ``Plan.table`` prints."""

    terms: dict[str, float]
    base: float  # S + the root's gathered parameters + O: alive at every forward and backward moment
    end_of_forward: float  # y_last + T_head, on top of base and the kept activations
    backward: list[float]  # per block i: G_rest + G_after_i + units in flight (+ own gradients when sharded)
    end_of_backward: float  # sharded: the root's gradients reduce-scattered (0 in one process)
    tail: float  # the backward before the blocks (the embeddings'), every block's gradients done
    optimizer: float  # P_opt + L
    parts: dict[str, dict[str, float]]  # the decision-independent parts of each moment (backward: of block 0's)
    gradients: list[float]  # per block i: the gradients alive in its backward
    in_flight: list[float]  # per block i: the gathered units alive in its backward
    between: list[float]  # per block i: D_i, what the code between the blocks added since O
    outside: list[float]  # per block i: R_i, what its backward holds beside the rest (backward[i] = these four)
    after: list[float]  # per block i: the backward of the code after it beside base and kept[:i] (0: no such moment)
    forward: list[float]  # per block i: the forward before it beside base and the blocks before, D_i + x_i + F_i
    transient: list[float]  # per block i: F_i
    forward_units: list[float]  # per block i: the gathered units alive in its forward

    @classmethod
    def of(cls, profile: ModelProfile, sharding: Sharding | None) -> _Moments:
        t = terms(profile, sharding)
        s = sharding.shards if sharding else 1
        units = gathered(profile, s)
        shard = profile.grad_shard_scale / s  # per byte of a computed gradient
        gradients, grads_after = [0.0] * len(profile.blocks), 0.0
        in_flight = [0.0] * len(profile.blocks)
        # The root's gradients stay whole until its reduce-scatter, the last of the step.
        rest = profile.grad_rest_bytes
        kept_whole = units and sharding is not None and not sharding.reshard_after_forward
        rest_at = profile.grad_rest_at or [rest] * len(profile.blocks)
        # Accumulating, a micro-batch's backward adds into the gradients (shards) the
        # micro-batches before made, which before_blocks and tail_transient count already
        # (autoconfigure's held_gradients): the blocks' reduced shards are added and their
        # reduce outputs freed ([Note: Releasing the reduce output]), and without gathered
        # copies every gradient is added in place, the root's too.
        replicas = sharding is not None and sharding.shards < sharding.world_size and s > 1  # hybrid: outputs kept
        # replicated (W x 1 units): the root's gradients are copied into a send buffer to be all-reduced
        replicas_of_one = sharding is not None and sharding.world_size > 1 and s == 1
        after_at = 0.0 if profile.accumulating and not replicas else 1.0
        in_place = 0.0 if profile.accumulating and not units else 1.0
        for i in reversed(range(len(profile.blocks))):
            own = profile.blocks[i].grad_bytes if units else 0  # unsharded until reduce-scattered
            # whole (sharded: until the root's reduce-scatter)
            gradients[i] = rest_at[i] * in_place + grads_after * after_at + own
            # units in flight: two blocks, or (kept gathered from forward) blocks 0..i
            in_flight[i] = sum(b.param_bytes for b in profile.blocks[: i + 1]) if kept_whole else t["unit_buffers"]
            # in its forward: the same blocks whole (kept gathered: 0..i; else it and the next)
            grads_after += profile.blocks[i].grad_bytes * shard
        eob, tail = _after_the_blocks(profile, t, s, units, grads_after, after_at)
        between = [float(d) for d in profile.between] or [0.0] * len(profile.blocks)
        outside = [float(r) for r in profile.backward_outside] or [0.0] * len(profile.blocks)
        # the code's backward after block i: block i's gradients made (sharded: whole until
        # reduced), its input perhaps still held (a checkpoint's saved input), E_i beside
        # ([Note: What the backward holds outside the blocks])
        after = [
            g + u + d + b.grad_bytes * in_place + b.input_bytes + e if e else 0.0
            for g, u, d, b, e in zip(gradients, in_flight, between, profile.blocks, profile.after_outside)
        ] or [0.0] * len(profile.blocks)
        transient = [float(f) for f in profile.forward_transient] or [0.0] * len(profile.blocks)
        # forward before block i (its input from block i-1 and the code making it), beside D_i
        forward = [d + b.input_bytes + f for d, b, f in zip(between, profile.blocks, transient)]
        base = {k: t[k] for k in ("state", "gather_buffers", "before_blocks", "workspace")}
        if profile.accumulating and units:  # each unit's reduce tail of the micro-batch before, read at its forward
            base["bookkeeping"] = tail["bookkeeping"] = _BOOKKEEPING * (len(gradients) + 1)
        # blocks kept gathered from forward (reshard_after_forward=False) are whole at its end too
        kept_gathered = t["unit_buffers"] if kept_whole else 0.0
        end = {"between_blocks": float(profile.between_end), "last_output": t["last_output"]}
        end["head_transient"] = t["head_transient"]
        if kept_whole:
            end["kept_gathered"] = kept_gathered
        return cls(
            terms=t,
            base=sum(base.values()),
            end_of_forward=profile.between_end + t["last_output"] + t["head_transient"] + kept_gathered,
            backward=[g + u + d + r for g, u, d, r in zip(gradients, in_flight, between, outside)],
            end_of_backward=sum(eob.values()) if units or replicas_of_one else 0.0,
            tail=sum(tail.values()),
            optimizer=t["optimizer_peak"] + profile.leftover + t["workspace"],
            parts={
                "end of forward": {**base, **end},
                "backward": {**base, "unit_buffers": t["unit_buffers"]},
                "backward before the blocks": tail,
                "end of backward": eob,
                "optimizer step": {
                    "optimizer_peak": t["optimizer_peak"],
                    "leftover": float(profile.leftover),
                    "workspace": t["workspace"],
                },
            },
            gradients=gradients,
            in_flight=in_flight,
            between=between,
            outside=outside,
            after=after,
            forward=forward,
            transient=transient,
            forward_units=list(in_flight) if units else [0.0] * len(profile.blocks),
        )

    def parts_at(self, where: str, profile: ModelProfile, kept: Sequence[float], decisions: list[str]) -> dict:
        """The named parts of moment ``where`` under ``decisions``: they add up to its bytes."""
        held = held_inputs(profile, decisions)
        stash = stashed(profile, decisions)
        if where == "end of forward":
            return {
                **self.parts[where],
                "held_inputs": held[-1],
                "kept_activations": sum(kept),
                "offload_stash": stash[-1],
            }
        if where.startswith("forward before "):
            i = block_names(profile).index(where.removeprefix("forward before "))
            return {
                **self.parts["backward"],
                "unit_buffers": 0.0,
                "between_blocks": self.between[i],
                "held_inputs": held[i],
                "kept_activations": sum(kept[:i]) + profile.blocks[i].input_bytes,
                "offload_stash": stash[i],
                "forward_transient": self.transient[i],
            }
        if where.startswith("forward of "):
            i = block_names(profile).index(where.removeprefix("forward of "))
            return {
                **self.parts["backward"],
                "unit_buffers": self.forward_units[i],
                "between_blocks": self.between[i],
                "held_inputs": held[i],
                "kept_activations": sum(kept[:i]),
                "offload_stash": stash[i],
                "block_forward": float(profile.blocks[i].forward_peak.get(decisions[i], 0)),
            }
        if where.startswith("backward after "):
            i = block_names(profile).index(where.removeprefix("backward after "))
            b = profile.blocks[i]
            return {
                **self.parts["backward"],
                "unit_buffers": self.in_flight[i],
                "between_blocks": self.between[i],
                "gradients": self.gradients[i] + b.grad_bytes,
                "held_inputs": held[i],
                "kept_activations": sum(kept[:i]) + b.input_bytes,
                "backward_outside": float(profile.after_outside[i]),
            }
        if not where.startswith("backward of "):
            return dict(self.parts[where])
        i = block_names(profile).index(where.removeprefix("backward of "))
        b = profile.blocks[i]
        return {
            **self.parts["backward"],
            "unit_buffers": self.in_flight[i],
            "between_blocks": self.between[i],
            "backward_outside": self.outside[i],
            "gradients": self.gradients[i],
            "held_inputs": held[i],
            "kept_activations": sum(kept[:i]),
            "block_backward": b.peak[decisions[i]],
        }


def _after_the_blocks(
    profile: ModelProfile, t: dict[str, float], s: int, units: bool, grads_after: float, after_at: float
) -> tuple[dict[str, float], dict[str, float]]:
    """_Moments' parts of the end of backward (the root's reduce-scatter) and of the backward
    before the blocks: what is alive once the blocks' backward is done (``grads_after``: the
    blocks' gradient shards, counted at ``after_at``)."""
    rest, shard, send = profile.grad_rest_bytes, profile.grad_shard_scale / s, profile.reduce_scale
    # The root's reduce-scatter, after its parameters were freed: its whole gradients, the
    # send buffer they are copied into (as large, in the reduce dtype) and the shard it
    # receives. Under mixed precision ([Note: Forecasts under mixed precision]) the copy-in
    # casts: one rank casts into the shard's gradient, staged in the compute dtype
    # (_chunk_cat's own buffer); more ranks stage the cast in a buffer of the reduce dtype
    # beside the send buffer, before the shard exists.
    # Where the copy-in casts, every trainable parameter of the root is in it (one without a
    # gradient sends zero rows in the compute dtype: 0.78x the measured peak without them);
    # with accumulation the root's shard of the micro-batches before is alive beside
    local, cast = s == 1, profile.reduce_scale != 1.0
    whole = rest if profile.root_grad_bytes is None else profile.root_grad_bytes
    reduced = rest * send if profile.root_reduce_bytes is None else profile.root_reduce_bytes
    # (the blocks' reduce outputs are freed once added, [Note: Releasing the reduce output];
    # with replicas they are held to the end of backward, as large as the blocks' shards)
    root_shard = reduced / s if cast and not local else rest * shard  # the whole reduce output, views held
    held = root_shard + grads_after * after_at if profile.accumulating and units else 0.0
    root_grads, root_reduce = grads_after + rest * shard + held, rest * (1 + send)
    if local:
        root_grads, root_reduce = grads_after + rest * shard + held, rest * (1 + cast)
    elif cast:
        root_grads, root_reduce = grads_after + held, whole + 2 * reduced
    eob = {"state": t["state"], "gradients": root_grads, "root_reduce": root_reduce}
    eob["workspace"] = t["workspace"]
    # a cast's staging buffer carries the send buffer's padding (16-byte slots per rank) too:
    # under mixed precision 2 KiB per unit and rank (measured beyond the other terms: 3.6 KB
    # for BERT's 3 units at W = 4; 2.5 KB for GPT-2's at W = 2 accumulating)
    eob["bookkeeping"] = _BOOKKEEPING * (len(profile.blocks) + 1) * (2 * s if cast and not local else 1)
    # The embeddings' backward: the first block's reduce-scatter still in flight (its send
    # buffer and shard; one rank: the shard's gradient alone), the root's full parameters.
    first = profile.blocks[0].grad_bytes * (shard if local else send + shard) if units else 0.0
    tail = {"state": t["state"], "gather_buffers": t["gather_buffers"]}
    tail["gradients"] = grads_after * after_at + first
    tail["workspace"] = t["workspace"]
    tail["tail_transient"] = t["tail_transient"]
    return eob, tail


def held_inputs(profile: ModelProfile, decisions: Sequence[str] | None) -> list[float]:
    """Per block j, then for the end of forward: the bytes of the inputs a block before it, not
    kept, holds that the step with every block kept has freed by then (``decisions`` None: as if
    no block were kept, the solver's bound); see [Note: Inputs a checkpointed block holds]."""
    out = [0.0] * (len(profile.blocks) + 1)
    for nbytes, dead_from, given in profile.released_inputs:
        if decisions is None or any(decisions[k] != "keep" for k in given):
            for j in range(dead_from, len(out)):
                out[j] += nbytes
    return out


# [Note: The offload stash]
# On a device with streams an offloaded block's saved input is copied to the host on the side
# stream and its source stays referenced in the forward's stash until the copy has had the
# next offloaded block's forward to finish ([Note: Host offload]): a new group releases the
# sources of groups before the one before it. So through forward and until backward takes them
# back, the device still holds the inputs of the last two offloaded blocks (at the forward of
# an offloaded block: the one before it; its own input is its forward's), which the profile's
# kept bytes for offload leave out (the fake step offloads nothing). BERT-large, batch 16,
# every block offloaded: 31.7 MiB of tensors above the forecast at the end of forward
# without it on an H100 (gpu_h100.json part b); with it, one block input above, because the
# first block's input, counted before the blocks, leaves the device with the stash too (not
# subtracted: the profile cannot tell what else holds it). The stash's bound of 5 tensors
# (STASH) is not applied: an upper bound. 0 groups (Target.offload_stash) where no streams run.
def stashed(profile: ModelProfile, decisions: Sequence[str]) -> list[float]:
    """Per block i (its forward), then for the end of forward: the inputs of offloaded blocks
    before it that the offload stash holds on the device ([Note: The offload stash])."""
    out = [0.0] * (len(profile.blocks) + 1)
    if not profile.offload_stash:
        return out
    moved = [i for i, d in enumerate(decisions) if DecisionKind(d).spec.moves_input]
    for i in range(len(out)):
        before = [j for j in moved if j < i]
        keep = profile.offload_stash - (1 if i in moved else 0)  # a new group releases the older ones
        out[i] = float(sum(profile.blocks[j].input_bytes for j in before[len(before) - keep :])) if keep > 0 else 0.0
    return out


def _stash_bound(profile: ModelProfile, allowed: Sequence[str]) -> float:
    """The most the stash can hold under any decisions from ``allowed`` (the solver's bound)."""
    if not profile.offload_stash or not any(DecisionKind(d).spec.moves_input for d in allowed):
        return 0.0
    largest = sorted((b.input_bytes for b in profile.blocks), reverse=True)
    return float(sum(largest[: profile.offload_stash]))


def timeline(profile: ModelProfile, decisions: list[str], sharding: Sharding | None = None) -> list[dict]:
    """Every moment :func:`forecast` takes the peak of, in the order of the step, each with its
    named parts (bytes per rank), which add up to its bytes."""
    m = _Moments.of(profile, sharding)
    kept = [b.kept[d] for b, d in zip(profile.blocks, decisions)]
    out: list[dict[str, Any]] = []
    for name in _moment_names(profile, m):
        parts = m.parts_at(name, profile, kept, decisions)
        out.append({"moment": name, "parts": parts, "total": float(sum(parts.values()))})
    return out


def _moment_names(profile: ModelProfile, m: _Moments) -> list[str]:
    names = []
    for b, f in zip(block_names(profile), m.transient):
        names += [f"forward before {b}"] if f else []
        names.append(f"forward of {b}")
    names.append("end of forward")
    for i, b in reversed(list(enumerate(block_names(profile)))):
        names += [f"backward of {b}", *([f"backward after {b}"] if m.after[i] else [])]
    names += ["backward before the blocks", *(["end of backward"] if m.end_of_backward else [])]
    return [*names, "optimizer step"]


def forecast(profile: ModelProfile, decisions: list[str], sharding: Sharding | None = None) -> dict[str, Any]:
    """Predicted peak of a step under ``decisions``, with the moment that sets it, the
    decision-independent terms (``term:``) and the parts the peak's moment adds up (``part:``)."""
    m = _Moments.of(profile, sharding)
    kept = [b.kept[d] for b, d in zip(profile.blocks, decisions)]
    held = held_inputs(profile, decisions)
    stash = stashed(profile, decisions)
    moments, names = {}, block_names(profile)
    for i, b in enumerate(profile.blocks):
        if m.transient[i]:
            moments[f"forward before {names[i]}"] = m.base + held[i] + sum(kept[:i]) + stash[i] + m.forward[i]
        block_forward = m.forward_units[i] + m.between[i] + b.forward_peak.get(decisions[i], 0)
        moments[f"forward of {names[i]}"] = m.base + held[i] + sum(kept[:i]) + stash[i] + block_forward
    moments["end of forward"] = m.base + held[-1] + sum(kept) + stash[-1] + m.end_of_forward
    for i in reversed(range(len(profile.blocks))):
        b = profile.blocks[i]
        moments[f"backward of {names[i]}"] = m.base + held[i] + m.backward[i] + sum(kept[:i]) + b.peak[decisions[i]]
        if m.after[i]:
            moments[f"backward after {names[i]}"] = m.base + held[i] + sum(kept[:i]) + m.after[i]
    moments["backward before the blocks"] = m.tail
    if m.end_of_backward:
        moments["end of backward"] = m.end_of_backward
    moments["optimizer step"] = m.optimizer
    where = max(moments, key=moments.__getitem__)
    extra = sum(b.extra_time[d] for b, d in zip(profile.blocks, decisions))
    return {
        "peak": moments[where],
        "at": where,
        "kept_activations": sum(kept),
        "extra_time": extra,
        "step_time": profile.step_time + extra,
        **{f"term:{k}": v for k, v in m.terms.items()},
        **{f"part:{k}": v for k, v in m.parts_at(where, profile, kept, decisions).items()},
    }


# [Note: The planner's solver]
# The peak terms of [Note: The planner's memory model] are sums over a chain: the backward
# moment of block i depends on the bytes kept by blocks before it plus B_i of its own
# decision, the end-of-forward moment on the bytes kept by all. A dynamic program over the
# blocks in forward order carries, for every total of kept bytes so far (in bins of `grain`
# bytes, each block's bytes rounded up, so a solution never exceeds the budget), the least
# extra time reaching it. Each block's decisions are allowed only where its backward moment
# fits; at the end the end-of-forward moment must fit. Exact for the binned sizes; with a grain
# of budget/8192 the rounding costs at most n_blocks * grain bytes of headroom (0.15% of the
# budget for 12 blocks). numpy arrays make 200 blocks a few milliseconds.
def solve(
    profile: ModelProfile, budget: int, sharding: Sharding | None = None, allowed: tuple[str, ...] = DECISIONS
) -> list[str] | None:
    """Least-extra-time decisions whose forecast peak fits ``budget``; None if none fits. A
    module run several times takes one decision for all its calls: each decision for it is
    tried, the other blocks solved as usual ([Note: A module run several times])."""
    keep = ["keep"] * len(profile.blocks)
    if profile.released_inputs and "keep" in allowed and all("keep" in b.kept for b in profile.blocks):
        if forecast(profile, keep, sharding)["peak"] <= budget:  # the chain below bounds H as if none kept
            return keep
    paths = [b.path for b in profile.blocks]
    shared = sorted({p for p in paths if paths.count(p) > 1})
    if not shared:
        return _solve_chain(profile, budget, sharding, allowed)
    combos = (
        itertools.product(allowed, repeat=len(shared)) if len(shared) <= 3 else ((d,) * len(shared) for d in allowed)
    )
    best: tuple[float, list[str]] | None = None
    for combo in combos:
        fixed = dict(zip(shared, combo))
        blocks = [_only(b, fixed[b.path]) if b.path in fixed else b for b in profile.blocks]
        got = _solve_chain(dataclasses.replace(profile, blocks=blocks), budget, sharding, allowed)
        if got is not None:
            extra = sum(b.extra_time[d] for b, d in zip(profile.blocks, got))
            best = (extra, got) if best is None or extra < best[0] else best
    return None if best is None else best[1]


def _only(b, decision: str):
    """Block ``b`` with ``decision`` its one choice (none, when it cannot take it)."""
    keep = lambda d: {k: v for k, v in d.items() if k == decision}  # noqa: E731
    return dataclasses.replace(b, kept=keep(b.kept), peak=keep(b.peak), extra_time=keep(b.extra_time))


def _solve_chain(
    profile: ModelProfile, budget: int, sharding: Sharding | None, allowed: tuple[str, ...]
) -> list[str] | None:
    """The chain's decisions at ``budget``. The offload stash ([Note: The offload stash]) is
    not a term of the chain (it depends on which blocks offload last): a solution it takes
    over the budget is solved again under the budget less the excess (twice at most), then
    with the stash's bound taken off every moment."""
    got = _solve_chain_at(profile, budget, sharding, allowed, 0.0)
    bound = _stash_bound(profile, allowed)
    less = 0.0
    for _ in range(2):
        if got is None or not bound:
            return got
        over = forecast(profile, got, sharding)["peak"] - budget
        if over <= 0:
            return got
        less += over
        got = _solve_chain_at(profile, budget, sharding, allowed, less)
    if got is not None and forecast(profile, got, sharding)["peak"] <= budget:
        return got
    return _solve_chain_at(profile, budget, sharding, allowed, bound)


def _solve_chain_at(
    profile: ModelProfile, budget: int, sharding: Sharding | None, allowed: tuple[str, ...], stash: float
) -> list[str] | None:
    m = _Moments.of(profile, sharding)
    if max(m.optimizer, m.end_of_backward, m.tail) > budget:
        return None
    grain = max(budget / BINS, 1.0)
    n = len(profile.blocks)
    held = held_inputs(profile, None)  # a bound: see [Note: Inputs a checkpointed block holds]
    bins = np.arange(BINS + 1)
    cost = np.full(BINS + 1, np.inf)
    cost[0] = 0.0
    choices = np.zeros((n, BINS + 1), dtype=np.int8)
    for i, b in enumerate(profile.blocks):
        cap = budget - m.base - held[i] - stash
        new = np.full(BINS + 1, np.inf)
        pick = np.zeros(BINS + 1, dtype=np.int8)
        for d in allowed:
            if d not in b.kept:  # [Note: A decision a block cannot take]
                continue
            # this block's forward and backward moments (and the code's before and after it where forecast has them)
            need = max(m.backward[i] + b.peak[d], m.forward_units[i] + m.between[i] + b.forward_peak.get(d, 0))
            need = max(need, m.after[i])
            fits = bins * grain + max(need, m.forward[i] if m.transient[i] else 0) <= cap  # per prefix
            q = max(0, int(np.ceil(b.kept[d] / grain)))
            if q > BINS:
                continue
            cand = np.full(BINS + 1, np.inf)
            src = np.where(fits, cost, np.inf)
            cand[q:] = src[: BINS + 1 - q] + b.extra_time[d]
            better = cand < new
            new[better] = cand[better]
            pick[better] = DECISIONS.index(d)
        cost = new
        choices[i] = pick
    end_cap = budget - m.base - held[-1] - stash - m.end_of_forward
    ok = np.where(bins * grain <= end_cap, cost, np.inf)
    if not np.isfinite(ok).any():
        return None
    at = int(np.argmin(ok))
    decisions: list[str] = []
    for i in reversed(range(n)):
        d = DECISIONS[choices[i, at]]
        decisions.append(d)
        at -= max(0, int(np.ceil(profile.blocks[i].kept[d] / grain)))
    return decisions[::-1]


def smallest_budget(profile: ModelProfile, sharding: Sharding | None = None, allowed=DECISIONS) -> int:
    """The smallest budget any plan fits (to the solver's grain), by bisection."""
    lo = 1
    hi = int(max(forecast(profile, ["keep"] * len(profile.blocks), sharding)["peak"], 1)) * 2
    while solve(profile, hi, sharding, allowed) is None:
        hi *= 2
    while hi - lo > max(hi // 2000, 1):
        mid = (lo + hi) // 2
        if solve(profile, mid, sharding, allowed) is None:
            lo = mid
        else:
            hi = mid
    return hi
