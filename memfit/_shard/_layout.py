"""Which ranks a unit shards over and which hold replicas of its shards: plain sharding over
one process group, or hybrid sharding (HSDP) over a 2-D (replicate x shard) device mesh."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from memfit._shard._device import compute_device

# [Note: Hybrid sharding]
# A 2-D mesh of R x S ranks (replicate x shard; torch's init_device_mesh(..., (R, S))): each
# row is a shard group of S ranks that splits the parameters (and so their gradients and the
# optimizer state) as plain sharding splits them over S ranks; the R rows hold the same shards.
# All-gathers stay inside the shard group. Gradients are reduce-scattered in the shard group
# (each rank then holds the sum over its row of its 1/S of the gradients), then all-reduced
# across the replicate group (the R ranks holding the same shard), so only that 1/S crosses
# the replicate dimension: per rank and step, in a ring, 2 (R-1)/R x (Psi/S) gradient elements
# (Psi: the unit's padded parameter count), against ZeRO-3's 3 (W-1)/W x Psi over every link
# when W = R x S ranks shard everything. The gradient is divided by R x S, the number of
# data-parallel ranks. With nodes as rows (a node's GPUs as one shard group) the all-gathers
# and reduce-scatters use the fast intra-node links and only the all-reduce the network.
# Checkpoints place every chunk as a DTensor [Replicate(), Shard(0)] on the 2-D mesh, so the
# replicas' identical chunks are written once and load at any layout (plain or hybrid).


@dataclass(frozen=True)
class Layout:
    """The process groups of a unit."""

    shard: dist.ProcessGroup  # the parameters are split over these ranks
    replicate: dist.ProcessGroup | None  # ranks holding the same shards (None: one replica)
    everyone: dist.ProcessGroup  # every data-parallel rank: checkpoints, broadcasts, exports
    mesh: DeviceMesh | None = None  # (replicate, shard) when hybrid

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate) if self.replicate is not None else 1

    @property
    def data_parallel(self) -> int:
        """Ranks the gradient is averaged over: replicas x shards."""
        return self.replicas * dist.get_world_size(self.shard)


class _Made:
    """The groups ``_group_over`` made under the current default group, by their ranks, held
    weakly: torch holds each until destroy_process_group, and one held here past it keeps its
    gloo threads running into the interpreter's teardown (see [Note: Ending a process group] in
    memfit/cli/_launch.py). A new default group starts afresh (the old groups are destroyed)."""

    def __init__(self) -> None:
        self.world: weakref.ref | None = None  # the default group these were made under
        self.groups: dict[tuple[int, ...], Callable[[], Any]] = {}  # weak references, or the marker

    def get(self, key: tuple[int, ...], make: Callable[[], Any]) -> Any:
        if self.world is None or self.world() is not dist.group.WORLD:
            self.world, self.groups = weakref.ref(dist.group.WORLD), {}
        ref = self.groups.get(key)
        group = ref() if ref is not None else None
        if group is None:
            group = make()
            # new_group's answer to a rank outside the group is a marker, not a group
            self.groups[key] = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else lambda: group
        return group


_GROUPS = _Made()


def _group_over(ranks: list[int], local: bool = False) -> dist.ProcessGroup:
    """A process group over ``ranks`` (the default group when they are all ranks), made once;
    ``local``: only those ranks take part in making it."""
    key = tuple(sorted(ranks))
    if key == tuple(range(dist.get_world_size())):
        return cast(dist.ProcessGroup, dist.group.WORLD)
    return _GROUPS.get(key, lambda: dist.new_group(list(key), use_local_synchronization=local))


# [Note: Partial reshard after forward]
# reshard_after_forward=k (1 < k < S, k dividing the shard group's size S; FSDP2's int, ZeRO++'s
# hpZ): after forward each rank keeps, instead of nothing beyond its shard, its 1/k of the
# unit's gathered buffer: the S/k slots of rows [j S/k, (j+1) S/k) of it, j its rank among the k
# consecutive ranks of its shard group that form its post-forward group (a node, when shard
# groups span nodes). Backward's all-gather then runs over those k ranks only and rebuilds the
# same S slots. Per non-root unit of padded size Psi_u (S slots) and wire element size b:
#   held from forward to backward:   Psi_u b / k   (True: 0 beyond the shard; False: Psi_u b)
#   backward all-gather per rank:    (k-1)/k Psi_u b over the post-forward group, 0 over the shard group
# (True: (S-1)/S Psi_u b over the shard group). k = S is True, k = 1 is False.


def post_forward_group(layout: Layout, size: int, where: str) -> dist.ProcessGroup | None:
    """The ``size`` consecutive ranks of this rank's shard group that backward gathers over
    (None: ``size`` is the whole shard group or 1); see [Note: Partial reshard after forward]."""
    ranks = dist.get_process_group_ranks(layout.shard)
    if size < 1 or len(ranks) % size:
        raise ValueError(
            f"{where}: reshard_after_forward={size} does not divide the shard group's {len(ranks)} ranks; pass "
            "True, False or a divisor of it (the ranks per node, usually)"
        )
    if size in (1, len(ranks)):
        return None
    start = ranks.index(dist.get_rank()) // size * size
    mine = ranks[start : start + size]
    # Every rank makes every group in the same order where all shard groups are known (a mesh
    # over every rank, or the default group); else (a plain group, a mesh sliced from a larger
    # one: each rank knows its own slice only) only the members make theirs.
    if layout.mesh is not None and layout.mesh.size() == dist.get_world_size():
        rows = layout.mesh.mesh.tolist()
    elif len(ranks) == dist.get_world_size():
        rows = [ranks]
    else:
        return _group_over(mine, local=True)
    for row in rows:
        for i in range(0, len(row), size):
            _group_over(row[i : i + size])
    return _group_over(mine)


def layout_of(group, mesh: DeviceMesh | None, where: str) -> Layout:
    """The layout ``shard(group=..., mesh=...)`` asks for; ``where`` names the caller in errors."""
    if mesh is None:
        if isinstance(group, (tuple, list)):  # torch FSDP's HYBRID_SHARD spelling: (shard, replicate)
            return hybrid_from_groups(group[0], group[1], where)
        group = group or dist.group.WORLD
        return Layout(group, None, group)
    if group is not None:
        raise ValueError(f"{where}: pass group= or mesh=, not both")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(
            f"{where}: mesh must be a 1-D or 2-D torch.distributed.device_mesh.DeviceMesh (replicate x shard, "
            f"from init_device_mesh); got {mesh!r}"
        )
    if mesh.ndim == 1:
        g = mesh.get_group()
        return Layout(g, None, g)
    names = mesh.mesh_dim_names or ("", "")
    if "shard" in names[0].lower() and "replic" in names[1].lower():
        raise ValueError(
            f"{where}: a 2-D mesh's dimensions are (replicate, shard), as in torch FSDP2; this mesh names them "
            f"{names}: build it in that order, init_device_mesh(device_type, (replicas, shards), "
            f"mesh_dim_names=({names[1]!r}, {names[0]!r}))"
        )
    replicate, shard = mesh.get_group(0), mesh.get_group(1)
    # The mesh's ranks, made by them only: a 2-D mesh sliced from a larger one (dp x tp x pp:
    # mesh["replicate", "shard"]) holds other ranks on other ranks, which never call for it.
    everyone = _group_over(mesh.mesh.flatten().tolist(), local=True)
    return Layout(shard, replicate if mesh.size(0) > 1 else None, everyone, mesh)


def hybrid_from_groups(shard, replicate, where: str) -> Layout:
    """The 2-D layout of torch FSDP's ``process_group=(shard_group, replicate_group)``."""
    rows: list = [None] * dist.get_world_size(replicate)
    dist.all_gather_object(rows, dist.get_process_group_ranks(shard), group=replicate)
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{where}: the shard groups of the replicas differ in size: {rows}")
    table = torch.tensor(rows, dtype=torch.int)
    device = compute_device(shard).type  # NCCL: cuda, also beside gloo ("cpu:gloo,cuda:nccl")
    mesh = DeviceMesh.from_group([replicate, shard], device, mesh=table, mesh_dim_names=("replicate", "shard"))
    return layout_of(None, mesh, where)


def hybrid_mesh(shard_size: int, where: str, device_type: str | None = None) -> DeviceMesh:
    """The (world / shard_size) x shard_size mesh over all ranks, consecutive ranks sharing a
    shard group (torchrun numbers a node's ranks consecutively), on ``device_type`` (default:
    the device the default group's backend communicates on: CUDA under NCCL, so that the
    mesh's DTensors and checkpoints name the device the shards are on)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"{where}: {world} ranks do not split into shard groups of {shard_size}; pick a shard size that "
            "divides the world size (usually the GPUs per node)"
        )
    device_type = device_type or compute_device(cast(dist.ProcessGroup, dist.group.WORLD)).type
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def end_mesh(mesh: DeviceMesh) -> None:
    """Destroy the process groups of ``mesh`` (made by :func:`hybrid_mesh`) but the default one,
    in the mesh's dimension order on every rank (NCCL's communicator aborts may be collective);
    the models sharded over it freed first, every rank past a barrier."""
    for g in dict.fromkeys(mesh.get_group(d) for d in range(mesh.ndim)):
        if g is not dist.group.WORLD:
            dist.destroy_process_group(g)
