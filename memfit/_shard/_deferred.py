"""Deferred initialisation: values for a sharded model built on the meta device, one unit or
one tensor at a time, so the full model never exists on one rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard._collectives import free_now
from memfit._shard._device import device_of_units, fill, moved
from memfit._shard._unit import units_of

__all__ = ["load_full_state_dict", "materialize"]


@torch.no_grad()
def materialize(model: nn.Module, init: Callable[[nn.Module], None] | None = None, seed: int = 0) -> nn.Module:
    """Give the parameters built on the meta device their initial values, one unit at a time:
    the unit's full parameters are allocated, ``init(module)`` (default: the module's own
    ``reset_parameters``) runs on each of its modules under the same seed on every rank, each
    rank keeps its rows, and the full parameters are freed. No communication; the peak is the
    local chunks plus one unit in full. Buffers built on the meta device start at zero unless
    ``init`` or ``reset_parameters`` sets them (BatchNorm's do)."""
    for i, unit in enumerate(units_of(model)):
        todo = [sp for sp in unit.params if sp.deferred]
        if not todo:
            continue
        torch.manual_seed(seed * 1_000_003 + i)  # the same values on every rank
        for sp in unit.params:
            sp.alloc_full()
            sp.register(sp.full)
        try:
            for m in unit.managed:
                if init is not None:
                    init(m)
                elif hasattr(m, "reset_parameters") and (m._parameters or m._buffers):
                    m.reset_parameters()
            for sp in todo:
                sp.keep_rows(sp.full, unit.rank)
                sp.deferred = False
        finally:
            for sp in unit.params:
                sp.register(sp.sharded)
                sp.free_full()
    return model


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> nn.Module:
    """Load full tensors held by rank 0 (``state_dict``; other ranks pass None) into a sharded
    model, streamed one tensor at a time: rank 0 broadcasts it on the compute device (where
    NCCL takes it), every rank keeps its rows. No rank holds more than its chunks plus one
    full tensor beyond what rank 0 already has."""
    units = units_of(model)
    group = units[0].layout.everyone  # rank 0 of all ranks holds it, whatever the replicas
    device = device_of_units(units)
    src = dist.get_global_rank(group, 0)
    shards = {id(sp.sharded): sp for u in units for sp in u.params}
    rank = dist.get_rank(group)
    names = list(model.state_dict(keep_vars=True).items())
    # Checked on rank 0 before any broadcast, and shared, so no rank waits in vain.
    box = [_mismatch(names, state_dict, shards) if rank == 0 else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0]:
        raise RuntimeError(f"memfit.load_full_state_dict: the state dict does not match the model: {box[0]}")
    done: set[int] = set()
    for name, t in names:
        if id(t) in done:  # tied: loaded once
            continue
        done.add(id(t))
        sp = shards.get(id(t))
        shape = sp.shape if sp is not None else t.shape
        if rank == 0:
            buf = moved(state_dict[name].detach().to(t.dtype), device, copy=True)
        else:
            buf = torch.empty(shape, dtype=t.dtype, device=device)
        if rank == 0 and tuple(buf.shape) != tuple(shape):
            raise RuntimeError(
                f"memfit.load_full_state_dict: '{name}' is {list(buf.shape)}, the model has {list(shape)}"
            )
        dist.broadcast(buf, src=src, group=group)
        if sp is not None:
            sp.keep_rows(buf, sp.owner.rank)
            sp.deferred = False
        else:
            fill(t, buf)
        if buf.device.type == "cpu":
            free_now(buf)
    return model


def _mismatch(names: list[tuple[str, torch.Tensor]], state_dict: dict[str, torch.Tensor], shards: dict) -> str | None:
    """What keeps ``state_dict`` from loading into the model (missing, unexpected keys, shapes), or None."""

    def full_shape(t):
        sp = shards.get(id(t))
        return tuple(sp.shape) if sp is not None else tuple(t.shape)

    missing = [n for n, _ in names if n not in state_dict]
    unexpected = [n for n in state_dict if n not in dict(names)]
    shapes = [
        f"'{n}' is {list(state_dict[n].shape)}, the model has {list(full_shape(t))}"
        for n, t in names
        if n in state_dict and tuple(state_dict[n].shape) != full_shape(t)
    ]
    if missing or unexpected or shapes:
        return f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; {'; '.join(shapes[:5])}"
    on_meta = [n for n, _ in names if n in state_dict and state_dict[n].is_meta]
    if on_meta:
        return f"tensors on the meta device (no values to load): {on_meta[:10]}"
    return None
