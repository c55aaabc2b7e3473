"""What ``optimizer.state_dict()`` and ``load_state_dict()`` mean for the parameters of a
sharded model: each state tensor shaped like a parameter's chunk is a DTensor sharded like it."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from memfit._shard._param import ShardedParam, shard_of
from memfit._shard._state_dict import as_dtensor
from memfit._shard._unit import Unit

__all__ = ["from_dtensors_or_full", "install_optimizer_state_hooks", "localize_loaded_state"]

# [Note: Optimizer state of a sharded model]
# An optimizer of a sharded model holds each sharded parameter's chunk, so its state (Adam's
# exp_avg, SGD's momentum_buffer) is chunks too. Handed out as plain tensors under the full
# names, torch.distributed.checkpoint takes them for replicated tensors and keeps rank 0's
# (silent loss), or refuses uneven shapes; `get_state_dict(..., full_state_dict=True)` returns
# chunks. So, as for the model's state_dict (See [Note: state_dict of a sharded model]), the
# optimizer's `state_dict()` puts in a DTensor for every state tensor shaped like a sharded
# parameter's chunk: placed Shard(0) over the unit's group, its local part the state tensor
# itself (no copy, no communication), its shape the parameter's full shape. Scalars (`step`)
# stay plain: every rank holds the same. This is what torch's FSDP2 optimizer state looks like
# (there the parameters are DTensors), so `get_state_dict` / `set_state_dict`, DCP at any
# world size and `full_state_dict=True` (full tensors) work unchanged.
# `load_state_dict` takes such DTensors (any Shard(0) layout: `to_local()` when it is this
# rank's chunk, else each rank keeps its rows of `full_tensor()`), full tensors shaped like the
# parameter (each rank keeps its rows), or plain chunks (as before: this rank's own state).
# The hooks are installed on an optimizer at its first step (memfit's optimizer step pre-hook
# sees every step); torch's `get_state_dict` / `set_state_dict` step a new optimizer first.
# A state loaded into an optimizer without the hooks is made local at its first step too.

_INSTALLED = "_memfit_state_hooks"


def install_optimizer_state_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` / ``load_state_dict()`` speak DTensors for the states of
    sharded parameters (once per optimizer)."""
    if getattr(optimizer, _INSTALLED, False):
        return
    optimizer.register_state_dict_post_hook(_to_dtensors)
    optimizer.register_load_state_dict_pre_hook(from_dtensors_or_full)
    setattr(optimizer, _INSTALLED, True)


def _is_state_of(value: Any, chunk: torch.Tensor) -> bool:
    """A per-element state of the parameter whose chunk is ``chunk``."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == chunk.shape


def _params_by_key(optimizer: torch.optim.Optimizer, groups: list[dict]) -> dict[Any, torch.Tensor]:
    """The optimizer's parameter behind each key of a state dict's groups (ids, or names as
    torch's get_state_dict writes them), matched by position as ``Optimizer.load_state_dict`` does."""
    keys = [k for g in groups for k in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return dict(zip(keys, params))


def _to_dtensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    by_key = _params_by_key(optimizer, state_dict["param_groups"])
    state = dict(state_dict["state"])  # the inner dicts are the optimizer's own: replace, never write
    for key, st in state.items():
        p = by_key.get(key)
        if p is None or (sp := shard_of(p)) is None:
            continue
        state[key] = {k: as_dtensor(sp, cast(Unit, sp.owner), v) if _is_state_of(v, p) else v for k, v in st.items()}
    return {**state_dict, "state": state}


def _local(value: torch.Tensor, sp: ShardedParam, chunk: torch.Tensor, where: str) -> torch.Tensor:
    """This rank's rows of a loaded state tensor (a DTensor or a full tensor) of ``sp``."""
    unit = cast(Unit, sp.owner)  # a sharded parameter has its unit
    if isinstance(value, DTensor):
        same = value.placements == (Shard(0),) and value.device_mesh.size() == unit.world
        if same and value.to_local().shape == chunk.shape:
            return value.to_local()
        value = value.full_tensor()
    if tuple(value.shape) != tuple(sp.shape):
        raise ValueError(
            f"memfit sharding: optimizer state '{where}' has shape {tuple(value.shape)}, the parameter "
            f"'{sp.fqn}' {tuple(sp.shape)} (its chunk on rank {unit.rank}: {tuple(chunk.shape)}); load a state "
            "dict of DTensors (torch.distributed.checkpoint.state_dict.get_state_dict) or of full tensors"
        )
    start = min(unit.rank * sp.chunk_rows, sp.rows)
    rows = value.detach().reshape(sp.rows, sp.row_numel)[start : start + sp.local_rows]
    return rows.reshape(chunk.shape)


def _loads_as_rows(key: str, value: Any, sp: ShardedParam, chunk: torch.Tensor) -> bool:
    """A loaded state of ``sp`` that each rank cuts its rows from: a DTensor, or a full tensor
    (never the optimizer's scalar ``step``, shaped as a 0-dim parameter is)."""
    if isinstance(value, DTensor):
        return True
    full = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(sp.shape) != tuple(chunk.shape)
    return full and not (key == "step" and len(sp.shape) == 0)


def from_dtensors_or_full(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` (keyed by ids or names) with this rank's chunk for every DTensor or full
    state of a sharded parameter of ``optimizer``: what its ``load_state_dict`` takes."""
    by_key = _params_by_key(optimizer, state_dict["param_groups"])
    state = dict(state_dict["state"])
    for key, st in state.items():
        p = by_key.get(key)
        if p is None or (sp := shard_of(p)) is None:
            continue
        state[key] = {k: _local(v, sp, p, f"{key}.{k}") if _loads_as_rows(k, v, sp, p) else v for k, v in st.items()}
    return {**state_dict, "state": state}


def localize_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """Turn DTensor or full states of sharded parameters, loaded before the hooks were installed,
    into this rank's chunks (the step cannot mix them with the plain chunk parameters)."""
    for p, st in optimizer.state.items():
        sp = shard_of(p)
        if sp is None:
            continue
        for k, v in list(st.items()):
            if _loads_as_rows(k, v, sp, p):
                st[k] = _local(v, sp, p, f"{sp.fqn}.{k}").to(dtype=v.dtype, device=p.device)
