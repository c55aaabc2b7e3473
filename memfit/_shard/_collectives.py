"""The collectives sharding uses, on torch.distributed (gloo on CPUs, NCCL on GPUs).

All-gather into one flat buffer and reduce-scatter out of one, both asynchronous (and, for
hybrid sharding, an all-reduce of the reduced shard across replicas). A rank
whose peers never reach the same collective gets, after the process group's timeout, an
error naming the unit and its rank. Bytes are counted per rank as a ring moves them
((W-1)/W of the full buffer per collective) so tests and benchmarks can check the volume.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class LinkStats:
    """What one rank sent over one process group: calls and bytes, by collective (ring bytes)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gather_bytes: float = 0.0
    reduce_scatter_bytes: float = 0.0
    all_reduce_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes


@dataclass
class CommStats(LinkStats):
    """Per-process counters of sharding's collectives (bytes a rank sends in a ring), in total
    and per process group (``by_group``: the group's global ranks -> :class:`LinkStats`)."""

    by_group: dict[tuple[int, ...], LinkStats] = field(default_factory=dict)

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = self.all_reduces = 0
        self.all_gather_bytes = self.reduce_scatter_bytes = self.all_reduce_bytes = 0.0
        self.by_group = {}

    def of(self, group) -> LinkStats:
        """The counters of ``group`` (a ProcessGroup; zeros if nothing was sent over it)."""
        return self.by_group.get(_ranks(group), LinkStats())

    def _add(self, kind: str, group, nbytes: float) -> None:
        link = self.by_group.setdefault(_ranks(group), LinkStats())
        for stats in (self, link):
            setattr(stats, kind + "s", getattr(stats, kind + "s") + 1)
            setattr(stats, kind + "_bytes", getattr(stats, kind + "_bytes") + nbytes)


STATS = CommStats()
# A group's global ranks, cached weakly: a group held here would outlive destroy_process_group
# (see [Note: Ending a process group] in memfit/cli/_launch.py).
_RANKS: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _ranks(group) -> tuple[int, ...]:
    group = group or dist.group.WORLD
    ranks = _RANKS.get(group)
    if ranks is None:
        ranks = _RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


def _ring_bytes(full: torch.Tensor, world: int) -> float:
    return full.numel() * full.element_size() * (world - 1) / world


def all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    """Start gathering every rank's ``inp`` into ``out`` (rank-major); returns the handle."""
    STATS._add("all_gather", group, _ring_bytes(out, dist.get_world_size(group)))
    return _all_gather(out, inp, group=group, async_op=True)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work | SlotOfAllReduce:
    """Start summing ``inp`` over ranks and keeping this rank's slice in ``out`` (on the CPU: see
    [Note: Reduce-scatter on gloo]); returns the handle."""
    STATS._add("reduce_scatter", group, _ring_bytes(inp, dist.get_world_size(group)))
    if inp.device.type == "cpu":
        work = dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return SlotOfAllReduce(work, out, inp, dist.get_rank(group), dist.get_world_size(group))
    return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


# [Note: Reduce-scatter on gloo]
# gloo's reduce-scatter clones its input, all-reduces the clone on a worker thread and, at
# wait(), copies this rank's slot of it into the output. The clone is freed when that worker
# drops its own reference, at a time of its choosing (see [Note: Ending a process group] in
# memfit/cli/_launch.py), so a step's peak held one unit's reduce buffer more or less from run
# to run (llama_8k W=2: 16.57 or 16.71 MiB measured). On the CPU memfit does the same all-reduce
# on its own send buffer, in place, which the unit frees as soon as the reduce is done (the
# same sums, bitwise, and one copy of the buffer less), and copies the slot at wait(). The
# bytes counted are the reduce-scatter's, as before.


class SlotOfAllReduce:
    """A reduce-scatter done as an all-reduce of ``inp`` in place: wait() copies this rank's slot
    of the sums into ``out`` (See [Note: Reduce-scatter on gloo])."""

    def __init__(self, work: dist.Work, out: torch.Tensor, inp: torch.Tensor, rank: int, world: int) -> None:
        self.work, self.out, self.inp, self.rank, self.world = work, out, inp, rank, world

    def wait(self) -> bool:
        self.work.wait()
        if self.inp is not None:
            self.out.copy_(self.inp.view(self.world, -1)[self.rank])
            self.inp = None
        return True


def all_reduce(tensor: torch.Tensor, group) -> dist.Work:
    """Start summing ``tensor`` over the ranks of ``group``, in place (a ring: a reduce-scatter
    then an all-gather, so 2 (W-1)/W of it leaves each rank)."""
    STATS._add("all_reduce", group, 2 * _ring_bytes(tensor, dist.get_world_size(group)))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: ranks diverged or a peer died."""


def wait(work: dist.Work, what: str, group) -> None:
    """Wait for ``work``; if it fails (gloo and NCCL fail a collective that outlives the
    process group's ``timeout``), raise an error that names this rank and ``what``."""
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(
            f"memfit sharding: rank {dist.get_rank(group)} failed in the {what}: another rank did not reach it "
            "within the process group's timeout (init_process_group(timeout=...)), or died. All ranks must run "
            f"the same forward and backward on the same sharded units in the same order. Cause: {e}"
        ) from e
