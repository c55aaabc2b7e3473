"""The collectives sharding uses, on torch.distributed (gloo on CPUs, NCCL on GPUs).

All-gather into one flat buffer and reduce-scatter out of one, both asynchronous. A rank
whose peers never reach the same collective gets, after the process group's timeout, an
error naming the unit and its rank. Bytes are counted per rank as a ring moves them
((W-1)/W of the full buffer per collective) so tests and benchmarks can check the volume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-process counters of sharding's collectives (bytes a rank sends in a ring)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_gather_bytes: float = 0.0
    reduce_scatter_bytes: float = 0.0

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = 0
        self.all_gather_bytes = self.reduce_scatter_bytes = 0.0


STATS = CommStats()


def _ring_bytes(full: torch.Tensor, world: int) -> float:
    return full.numel() * full.element_size() * (world - 1) / world


def all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    """Start gathering every rank's ``inp`` into ``out`` (rank-major); returns the handle."""
    world = dist.get_world_size(group)
    STATS.all_gathers += 1
    STATS.all_gather_bytes += _ring_bytes(out, world)
    return _all_gather(out, inp, group=group, async_op=True)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    """Start summing ``inp`` over ranks and keeping this rank's slice in ``out``."""
    world = dist.get_world_size(group)
    STATS.reduce_scatters += 1
    STATS.reduce_scatter_bytes += _ring_bytes(inp, world)
    return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


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
