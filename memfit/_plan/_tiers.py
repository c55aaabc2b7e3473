"""Planned tiers: where each unit's model state lives (device, host memory, a local disk) for
a budget per tier, at the least extra time (See [Note: Planned tiers])."""

from __future__ import annotations

import mmap
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from memfit._plan._budget import format_bytes, parse_bytes
from memfit._plan._profile_types import ModelProfile
from memfit._plan._solve import Sharding, state_offload

__all__ = ["TierChoice", "Tiers", "TiersError", "choose_tiers", "tiers_of", "unit_state"]

# [Note: Planned tiers]
# memfit.plan(..., host_budget=, disk=, disk_budget=) chooses, besides the blocks' checkpointing,
# where the model state (parameter shards, their gradients, the optimizer state) lives, in the
# granularity the runtime has: the whole model's state on the device or in host memory
# (memfit.shard(offload="cpu"); on a CPU it is in host memory already), and a set of blocks whose
# units keep their parameter shards and optimizer state in files on the disk tier
# (memfit.host_optimizer(disk=, disk_modules=); their gradients too: See [Note: Gradients on
# the disk tier]).
# Per rank, for a unit u with parameter shards P_u, gradients G_u and optimizer state S_u
# (S_u: the profile's optimizer bytes in proportion to u's trainable bytes):
#   host memory  = sum over units of P_u + G_u + S_u, less those of the disk units (+ buffers)
#   disk (held)  = sum over disk units of P_u + G_u + S_u, each of its three files a page larger
#   disk, a step = what the host step (memfit.host_optimizer) drops and writes back on the path
#                  it takes, each byte dropped read again at its next use. With a micro-batches
#                  and the step in backward (overlap, no max_norm: HostStep.in_backward) at the
#                  last of them, or after backward (max_norm, or overlap=False):
#                  - each forward releases the shards: a P_u read;
#                  - each backward that lands gradients (all a; under no_sync only the last)
#                    and does not step writes them behind it and releases the shards
#                    (DiskUnits.grads_landed): G_u written, P_u + G_u read;
#                  - a clip (max_norm; clip_grads, a unit's file at a time) reads the gradients
#                    for the norm (G_u read) and scales them (G_u read and written; by 1 within
#                    the norm: an upper bound there);
#                  - the step writes back and releases all three files (DiskUnits.stepped):
#                    P_u + G_u + S_u read and written.
#                  In backward, a = 1: 2 P_u + G_u + S_u read, P_u + G_u + S_u written; after
#                  backward with a clip (memfit train): 3 P_u + 4 G_u + S_u read, P_u + 3 G_u +
#                  S_u written. memfit.plan's max_norm=, accumulate=, overlap=, no_sync= say the
#                  path (`memfit plan` and `memfit train` pass --clip, the accumulation and
#                  train's no_sync at shard groups of 1; autoconfigure each configuration's).
# Time added to a step, priced: the host link and the CPU optimizer step where the state leaves an
# accelerator (state_offload: the shards and gradients across the link, the step's pass over host
# memory), and the disk's bytes a step over its bandwidth (not overlapped: an upper bound; pass
# the disk's own figure, e.g. from `dd`, as disk_bandwidth). The choice: every option (state on
# the device; in host memory with the k largest blocks on disk, k = 0..n) whose tiers all fit,
# solved for the device budget with what it frees there, and the least extra time among them.
# Forecast against what the tier holds and moves: tests/unit/test_plan_tiers.py.

DISK_BANDWIDTH = 1e9  # bytes/s assumed for a local disk when none is given (a SATA SSD; NVMe is faster)


class TiersError(ValueError):
    """No option's tiers all fit their budgets."""


@dataclass(frozen=True)
class Tiers:
    """A budget per tier beyond the device, per rank: ``host`` bytes of host memory (None: no
    limit), ``disk`` a directory on a local disk (None: no disk tier), ``disk_budget`` its bytes
    (None: its free space), ``disk_bandwidth`` its bytes per second."""

    host: int | None = None
    disk: str | None = None
    disk_budget: int | None = None
    disk_bandwidth: float = DISK_BANDWIDTH
    max_norm: float | None = None  # the host step's path (memfit.host_optimizer's): a clip,
    accumulate: int = 1  # backwards a step,
    overlap: bool = True  # a step in backward allowed,
    no_sync: bool = False  # the backwards before the last in no_sync (See [Note: Planned tiers])

    def __post_init__(self) -> None:
        if self.host is not None and self.host < 0:
            raise ValueError(f"memfit.plan: host_budget must be >= 0 bytes, got {self.host}")
        if self.disk_budget is not None and self.disk is None:
            raise ValueError("memfit.plan: disk_budget needs disk= (a directory on a local disk)")
        if not self.disk_bandwidth > 0:
            raise ValueError(f"memfit.plan: disk_bandwidth must be > 0 bytes/s, got {self.disk_bandwidth}")
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"memfit.plan: max_norm must be > 0 or None, got {self.max_norm!r}")
        if type(self.accumulate) is not int or self.accumulate < 1:
            raise ValueError(f"memfit.plan: accumulate must be an int >= 1, got {self.accumulate!r}")

    def disk_moves(self, params: int, grads: int, state: int) -> tuple[int, int]:
        """(reads, writes) a step of a disk unit holding these bytes (See [Note: Planned tiers])."""
        after = self.max_norm is not None or not self.overlap  # HostStep.in_backward is False
        landings = 1 if self.no_sync else self.accumulate  # backwards whose gradients land
        behind = landings if after else landings - 1  # of them, those that do not step
        clips = int(self.max_norm is not None)
        reads = self.accumulate * params + behind * (params + grads) + 2 * clips * grads + params + grads + state
        writes = behind * grads + clips * grads + params + grads + state
        return reads, writes

    def disk_room(self) -> int:
        if self.disk is None:
            return 0
        if self.disk_budget is not None:
            return self.disk_budget
        try:
            return shutil.disk_usage(self.disk).free
        except OSError as e:
            raise ValueError(f"memfit.plan: disk={self.disk!r} cannot be read ({e}); pass a directory") from None


def tiers_of(
    host_budget,
    disk: str | None,
    disk_budget,
    disk_bandwidth: float | None,
    max_norm: float | None = None,
    accumulate: int = 1,
    overlap: bool = True,
    no_sync: bool = False,
) -> Tiers | None:
    """memfit.plan's and memfit.autoconfigure's tier keywords as :class:`Tiers` (None: none
    given); max_norm, accumulate, overlap, no_sync: the host step's path."""
    if host_budget is None and disk is None and disk_budget is None:
        return None
    return Tiers(
        host=None if host_budget is None else parse_bytes(host_budget),
        disk=disk,
        disk_budget=None if disk_budget is None else parse_bytes(disk_budget),
        disk_bandwidth=disk_bandwidth or DISK_BANDWIDTH,
        max_norm=max_norm,
        accumulate=accumulate,
        overlap=overlap,
        no_sync=no_sync,
    )


@dataclass(frozen=True)
class TierChoice:
    """Where the model state lives and what each tier holds and moves per step, per rank."""

    state: str  # "device" or "host"
    disk_blocks: tuple[str, ...]  # block paths whose units keep shards, gradients and optimizer state on disk
    host_bytes: int  # model state in host memory (0: on the device)
    disk_bytes: int  # the disk tier's files
    disk_read_bytes: int  # a step's reads from the disk tier
    disk_write_bytes: int  # a step's writes to it
    device_saved: int  # bytes the state off the device takes off the device's peak
    extra_time: float  # seconds the tiers add to a step (priced)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    def line(self) -> str:
        where = "on the device" if self.state == "device" else f"in host memory ({format_bytes(self.host_bytes)})"
        disk = ""
        if self.disk_blocks:
            moved = format_bytes(self.disk_read_bytes + self.disk_write_bytes)
            n = len(self.disk_blocks)
            disk = f"; {n} block{'s' * (n != 1)} on disk ({format_bytes(self.disk_bytes)} held, {moved} a step)"
        off = f", {format_bytes(self.device_saved)} off the device's peak" if self.device_saved else ""
        return f"model state {where}{disk}{off}, +{self.extra_time * 1e3:.1f} ms a step"


def unit_state(profile: ModelProfile, shards: int) -> tuple[tuple[int, int, int], list[tuple[int, int, int]]]:
    """(parameters, gradients, optimizer state) bytes per rank outside the blocks and of each
    block (See [Note: Planned tiers])."""
    trainable = sum(b.grad_bytes for b in profile.blocks) + profile.grad_rest_bytes
    per = profile.optimizer_bytes / trainable if trainable else 0.0
    scale = (profile.master_bytes / profile.param_bytes) if profile.master_bytes else 1.0
    blocks = [
        (round(b.param_bytes * scale / shards), round(b.grad_bytes / shards), round(b.grad_bytes * per / shards))
        for b in profile.blocks
    ]
    rest_params = profile.param_bytes * scale - sum(b.param_bytes * scale for b in profile.blocks)
    root = (
        round(rest_params / shards),
        round(profile.grad_rest_bytes / shards),
        round(profile.grad_rest_bytes * per / shards),
    )
    return root, blocks


T = TypeVar("T")  # the device's solution


def choose_tiers(
    profile: ModelProfile,
    shard: Sharding | None,
    tiers: Tiers,
    accelerator: bool,
    solve_device: Callable[[int], tuple[float, T] | None],
) -> tuple[TierChoice, T]:
    """The tiers of least extra time whose budgets all fit, and the device's solution under them;
    ``solve_device(freed)``: the device's solution with ``freed`` bytes off its peak (None: no fit).
    Raises ValueError naming the tiers' needs where no option fits."""
    shards = shard.shards if shard else 1
    root, blocks = unit_state(profile, shards)
    everything = sum(map(sum, [root, *blocks]))
    order = sorted(range(len(blocks)), key=lambda i: (-sum(blocks[i]), -i))  # largest, last first
    room, page = tiers.disk_room(), mmap.PAGESIZE
    options: list[tuple[float, TierChoice, T]] = []
    ks = range(len(blocks) + 1) if tiers.disk is not None else range(1)
    if accelerator:
        device = solve_device(0)
        if device is not None:
            options.append((device[0], TierChoice("device", (), 0, 0, 0, 0, 0, 0.0), device[1]))
    offload = state_offload(profile, shard or Sharding(1)) if accelerator else (0.0, 0.0)
    for k in ks:
        on_disk = sorted(order[:k])
        held = sum(sum(blocks[i]) for i in on_disk)
        host = everything - held
        disk = held + 3 * page * k
        moves = [tiers.disk_moves(*blocks[i]) for i in on_disk]
        reads, writes = sum(r for r, _ in moves), sum(w for _, w in moves)
        if (tiers.host is not None and host > tiers.host) or disk > room:
            continue
        freed = int(offload[0]) if accelerator else held
        solved = solve_device(freed)
        if solved is None:
            continue
        extra = offload[1] + (reads + writes) / tiers.disk_bandwidth
        paths = tuple(profile.blocks[i].path for i in on_disk)
        choice = TierChoice("host", paths, int(host), int(disk), int(reads), int(writes), freed, extra)
        options.append((solved[0] + extra, choice, solved[1]))
    if not options:
        need = everything - sum(map(sum, blocks)) if tiers.disk is not None else everything
        raise TiersError(
            f"memfit.plan: no tiers fit: the model state is {everything} bytes per rank; host_budget="
            f"{tiers.host}, disk {tiers.disk!r} with {room} bytes; host memory needs at least {need} bytes "
            "(every block on disk) beside a device plan that fits: raise host_budget, give disk= more room, "
            "or shard over more ranks"
        )
    best = min(options, key=lambda o: o[0])  # ties: the first (the device, then fewer disk blocks)
    return best[1], best[2]
