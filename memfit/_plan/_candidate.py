"""One configuration memfit.autoconfigure prices (:class:`Candidate`) and its layout of the
ranks (:class:`Layout`): data, below both the search (memfit._plan._autoconfig) and its trials
(memfit._plan._trial). See [Note: Searching configurations]."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from memfit._plan._plan import Plan
from memfit._plan._solve import Sharding


@dataclass(frozen=True)
class Layout:
    """How W ranks hold the model: ``shard_size`` 1 replicates it (DDP-style: memfit.shard over
    a mesh of W replicas x 1), W fully shards it, anything between is hybrid sharding."""

    world_size: int
    shard_size: int = 1
    reshard_after_forward: bool = True  # sharded only: free a block's full parameters after its forward

    def __post_init__(self) -> None:
        Sharding(self.world_size, self.shard_size)  # its checks: whole numbers, a divisor

    @property
    def sharding(self) -> Sharding | None:
        if self.world_size == 1:
            return None
        return Sharding(self.world_size, self.shard_size, self.reshard_after_forward)

    def describe(self) -> str:
        if self.world_size == 1:
            return "one process"
        if self.shard_size == 1:
            return f"replicated x{self.world_size}"
        replicas = self.world_size // self.shard_size
        kind = "full shard" if replicas == 1 else f"hybrid {replicas}x{self.shard_size}"
        return kind + ("" if self.reshard_after_forward else ", no reshard")


@dataclass(frozen=True)
class Candidate:
    """One configuration, priced: its plan (None when no plan fits the budget), per-rank peak,
    the named terms of its step time (seconds; communication also in ring bytes per rank) and
    why it lost ("" for the pick)."""

    micro_batch: int
    accumulation: int
    layout: Layout
    plan: Plan | None
    peak: float  # bytes per rank: the plan's forecast, or the smallest budget any plan fits
    time: dict[str, float] = field(default_factory=dict)
    tokens_per_second: float = 0.0
    lost: str = ""
    measured: float | None = None  # seconds of a real step (AutoConfig.measure), None: not run
    measured_peak: int | None = None  # bytes per rank, the accelerator allocator's peak over those steps
    expected: float | None = None  # seconds a step is expected to take after measure() (see AutoConfig.trial_scale)

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def step_time(self) -> float:
        return self.time.get("step", float("inf"))

    @property
    def samples(self) -> int:
        """Samples a step trains on, over every rank."""
        return self.micro_batch * self.accumulation * self.layout.world_size

    def to_dict(self) -> dict:
        return {
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            **dataclasses.asdict(self.layout),
            "layout": self.layout.describe(),
            "fits": self.fits,
            "peak": self.peak,
            "head": self.plan.head if self.plan else None,
            "decisions": dict(self.plan.decisions) if self.plan else None,
            "time_s": dict(self.time),
            "tokens_per_second": self.tokens_per_second,
            "lost": self.lost,
            "measured_s": self.measured,
            "measured_peak": self.measured_peak,
            "expected_s": self.expected,
        }


class Searched(Protocol):
    """What memfit._plan._trial reads of a search: memfit._plan._autoconfig.AutoConfig, a
    frozen dataclass (its trials return a copy with fields replaced)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def best(self) -> Candidate: ...

    @property
    def candidates(self) -> tuple[Candidate, ...]: ...

    @property
    def budget(self) -> int: ...

    @property
    def tokens_per_sample(self) -> int: ...
