"""The collectives sharding uses, on torch.distributed (gloo on CPUs, NCCL on GPUs).

All-gather into one flat buffer and reduce-scatter out of one, both asynchronous (and, for
hybrid sharding, an all-reduce of the reduced shard across replicas). On gloo the
reduce-scatter is gloo's all-to-all or all-reduce (see :func:`reduce_scatter`). On gloo a
rank whose peers never reach the same collective gets, after the process group's timeout, an
error naming the unit and its rank (on NCCL, torch's watchdog ends it: see :func:`wait`).
Bytes are counted per rank as a ring moves them ((W-1)/W of the full buffer per collective) so
tests and benchmarks can check the volume.
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


STATS = CommStats()  # process-wide: counts every collective of the process, over all roots
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
    """Start gathering every rank's ``inp`` into ``out`` (rank-major); returns the handle.
    ``inp`` may be this rank's slot of ``out`` (an in-place all-gather, as NCCL allows; gloo
    gathers into a buffer of its own and then copies it into ``out``)."""
    STATS._add("all_gather", group, _ring_bytes(out, dist.get_world_size(group)))
    return _all_gather(out, inp, group=group, async_op=True)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work | _AddAfter:
    """Start summing ``inp`` over ranks and keeping this rank's slice in ``out``; ``inp`` is
    the caller's to lose (on gloo it may hold partial sums afterwards).

    gloo has no reduce-scatter of its own: its ``reduce_scatter_tensor`` clones the input on
    the calling thread, all-reduces the clone (2 (W-1)/W of the input leaves each rank) and
    copies this rank's slice out on ``wait`` (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``).
    On CPU tensors over gloo memfit does without the clone and, on two ranks, without half
    the bytes: each rank sends the other its slice (an all-to-all, (W-1)/W as in NCCL's ring)
    straight into ``out``, and adds its own slice on ``wait``; on more ranks it all-reduces
    ``inp`` in place and copies its slice out (an all-to-all would need a receive buffer as
    large as the input). The counters count the reduce-scatter asked for (what NCCL moves).
    See [Note: Reduce-scatter on gloo].
    """
    world = dist.get_world_size(group)
    STATS._add("reduce_scatter", group, _ring_bytes(inp, world))
    if inp.device.type != "cpu" or not _is_gloo(group):
        return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
    rank, slices = dist.get_rank(group), inp.view(world, -1)
    if world == 2:
        sizes = [0, out.numel()] if rank == 0 else [out.numel(), 0]  # nothing to itself
        work = dist.all_to_all_single(out, slices[1 - rank], sizes, sizes, group=group, async_op=True)
        return _AddAfter(work, out, slices[rank], add=True)
    work = dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _AddAfter(work, out, slices[rank], add=False)


class _AddAfter:
    """A gloo collective in flight whose ``wait`` then adds this rank's own slice into
    ``out`` (``add``), or copies its summed slice there: a reduce-scatter's handle (see
    :func:`reduce_scatter`)."""

    def __init__(self, work: dist.Work, out: torch.Tensor, mine: torch.Tensor, add: bool) -> None:
        self.work, self.out, self.add = work, out, add
        self.mine: torch.Tensor | None = mine  # None once waited

    def wait(self) -> bool:
        if self.mine is None:  # waited already
            return True
        self.work.wait()
        if self.add:
            self.out.add_(self.mine)
        else:
            self.out.copy_(self.mine)
        self.mine = None
        return True


_GLOO: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()  # per group, weakly


def _is_gloo(group) -> bool:
    """Whether ``group`` sends CPU tensors through gloo (asked once per group)."""
    group = group or dist.group.WORLD
    gloo = _GLOO.get(group)
    if gloo is None:
        try:
            backend = group._get_backend(torch.device("cpu"))
        except RuntimeError:  # no backend for CPU tensors in this group
            backend = None
        gloo = _GLOO[group] = isinstance(backend, dist.ProcessGroupGloo)
    return gloo


def free_now(*buffers: torch.Tensor) -> None:
    """Free buffers whose collective has completed, now (the CPU, no streams): gloo's worker
    thread drops its own references to them at a time of its choosing, which made a step's
    peak memory vary from run to run by up to a unit's buffers."""
    for t in buffers:
        t.untyped_storage().resize_(0)


# [Note: Reduce-scatter on gloo]
# gloo's reduce-scatter clones its input on the calling thread, all-reduces the clone on a worker
# thread and, at wait(), copies this rank's slot of it into the output. The clone is freed when
# that worker drops its own reference, at a time of its choosing (see [Note: Ending a process
# group] in memfit/cli/_launch.py), so a step's peak held one unit's reduce buffer more or less
# from run to run (llama_8k W=2: 16.57 or 16.71 MiB measured). memfit does without the clone
# (reduce_scatter above): on 2 ranks each sends the other its slice straight into the output
# (half the all-reduce's bytes) and adds its own at wait(); on more it all-reduces its own send
# buffer in place and copies its slot at wait(). The unit frees the send buffer as soon as the
# reduce is done. The same sums, bitwise; the bytes counted are the reduce-scatter's.


def all_reduce(tensor: torch.Tensor, group) -> dist.Work:
    """Start summing ``tensor`` over the ranks of ``group``, in place (a ring: a reduce-scatter
    then an all-gather, so 2 (W-1)/W of it leaves each rank)."""
    STATS._add("all_reduce", group, 2 * _ring_bytes(tensor, dist.get_world_size(group)))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: ranks diverged or a peer died."""


def wait(work: dist.Work, what: str, group) -> None:
    """Wait for ``work``; if it fails (gloo fails a collective that outlives the process group's
    ``timeout``), raise an error that names this rank and ``what``. On NCCL the wait only makes
    the current stream wait and returns: a hang is ended by NCCL's watchdog with torch's own
    error, not this one (docs/sharding.md)."""
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(
            f"memfit sharding: rank {dist.get_rank(group)} failed in the {what}: another rank did not reach it "
            "within the process group's timeout (init_process_group(timeout=...)), or died. All ranks must run "
            f"the same forward and backward on the same sharded units in the same order. Cause: {e}"
        ) from e
