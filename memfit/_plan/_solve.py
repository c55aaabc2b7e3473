"""Choose keep / selective / full / offload per block: least extra time under a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit._plan._profile import DECISIONS, ModelProfile

BINS = 8192


@dataclass(frozen=True)
class Sharding:
    """Per-rank accounting when the model is sharded over ``world_size`` ranks."""

    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"memfit.plan: world_size must be >= 1, got {self.world_size}")


def terms(profile: ModelProfile, sharding: Sharding | None) -> dict[str, float]:
    """The decision-independent terms, per rank (bytes)."""
    w = sharding.world_size if sharding else 1
    largest = max(b.param_bytes for b in profile.blocks)
    t = {
        # parameters and optimizer state (sharded); buffers (replicated)
        "state": (profile.state_bytes - profile.buffer_bytes) / w + profile.buffer_bytes,
        "before_blocks": profile.before_blocks,
        "grad_rest": profile.grad_rest_bytes / w,
        "last_output": profile.last_output,
        "head_transient": profile.head_transient,
        "optimizer_peak": profile.optimizer_peak / w,
        "gather_buffers": 0.0,
    }
    if sharding and w > 1:
        # The unit computing and the one prefetched exist in full; the root keeps its full
        # parameters (the parameters outside the blocks) from forward to backward. A gathered
        # buffer is an allocation of its own beside the rank's shard (counted in "state"): the
        # whole unit, not (1 - 1/W) of it (that under-forecast 32k-vocabulary Llama by 12%).
        rest = profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
        t["gather_buffers"] = 2 * largest + rest
    return t


@dataclass(frozen=True)
class _Moments:
    """The decision-independent part of every moment of [Note: The planner's memory model],
    per rank: what ``forecast`` adds up and what ``solve`` subtracts from the budget."""

    terms: dict[str, float]
    base: float  # S + gather buffers + O: alive at every forward and backward moment
    end_of_forward: float  # y_last + T_head, on top of base and the kept activations
    backward: list[float]  # per block i: G_rest + G_after_i (+ its own gradients when sharded)
    optimizer: float  # P_opt + gather buffers

    @classmethod
    def of(cls, profile: ModelProfile, sharding: Sharding | None) -> _Moments:
        t = terms(profile, sharding)
        w = sharding.world_size if sharding else 1
        backward, grads_after = [0.0] * len(profile.blocks), 0.0
        for i in reversed(range(len(profile.blocks))):
            own = profile.blocks[i].grad_bytes if w > 1 else 0  # unsharded until reduce-scattered
            backward[i] = t["grad_rest"] + grads_after + own
            grads_after += profile.blocks[i].grad_bytes / w
        return cls(
            terms=t,
            base=t["state"] + t["gather_buffers"] + t["before_blocks"],
            end_of_forward=t["last_output"] + t["head_transient"],
            backward=backward,
            optimizer=t["optimizer_peak"] + t["gather_buffers"],
        )


def forecast(profile: ModelProfile, decisions: list[str], sharding: Sharding | None = None) -> dict[str, float]:
    """Predicted peak of a step under ``decisions``, with the moment that sets it and its terms."""
    m = _Moments.of(profile, sharding)
    kept = [b.kept[d] for b, d in zip(profile.blocks, decisions)]
    moments = {"end of forward": m.base + sum(kept) + m.end_of_forward}
    for i in reversed(range(len(profile.blocks))):
        b = profile.blocks[i]
        moments[f"backward of {b.path}"] = m.base + m.backward[i] + sum(kept[:i]) + b.peak[decisions[i]]
    moments["optimizer step"] = m.optimizer
    where = max(moments, key=moments.get)
    extra = sum(b.extra_time[d] for b, d in zip(profile.blocks, decisions))
    return {
        "peak": moments[where],
        "at": where,
        "kept_activations": sum(kept),
        "extra_time": extra,
        "step_time": profile.step_time + extra,
        **{f"term:{k}": v for k, v in m.terms.items()},
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
    """Least-extra-time decisions whose forecast peak fits ``budget``; None if none fits."""
    m = _Moments.of(profile, sharding)
    if m.optimizer > budget:
        return None
    grain = max(budget / BINS, 1.0)
    n = len(profile.blocks)
    bins = np.arange(BINS + 1)
    cost = np.full(BINS + 1, np.inf)
    cost[0] = 0.0
    choices = np.zeros((n, BINS + 1), dtype=np.int8)
    for i, b in enumerate(profile.blocks):
        cap = budget - m.base - m.backward[i]
        new = np.full(BINS + 1, np.inf)
        pick = np.zeros(BINS + 1, dtype=np.int8)
        for d in allowed:
            fits = bins * grain + b.peak[d] <= cap  # this block's backward moment, per prefix
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
    end_cap = budget - m.base - m.end_of_forward
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
