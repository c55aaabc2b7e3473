"""What ``state_dict()`` and ``load_state_dict()`` mean on a sharded model: DTensors, not chunks."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from memfit._shard._device import moved
from memfit._shard._param import ShardedParam
from memfit._shard._unit import Unit

__all__ = ["install_state_dict_hooks"]

# [Note: state_dict of a sharded model]
# A sharded parameter's registered tensor is this rank's chunk, so a plain `state_dict()` would
# hand out chunks under the full names. Instead each sharded module's state_dict hook puts in
# a DTensor for every parameter its unit owns (as torch's FSDP2 does): placed Shard(0) on a 1-D
# mesh over the unit's group, its local part the chunk, its shape the full shape; a 0-dim
# parameter is a Partial("sum") DTensor whose local value is zero except on rank 0. Nothing is
# communicated; `dt.full_tensor()` gathers one tensor (every rank calls it), and
# torch.distributed.checkpoint saves and loads such a state dict at any world size.
# Full tensors on demand: inside `memfit.summon_full_params(model)` the modules register the
# full parameters and `state_dict()` holds those; `memfit.export_safetensors` and
# `save_pretrained` write the full model gathering one unit at a time.
# `state_dict(keep_vars=True)` returns the registered Parameters themselves (the chunks):
# they are the live variables, for code that must reach them (memfit's checkpoint files).
# `load_state_dict` takes DTensors (any Shard(0) layout), or full tensors shaped like the
# parameter (each rank keeps its rows); a plain tensor shaped like a chunk is refused.
# Offloaded shards (`offload="cpu"`) keep their host chunk as the local part, on a mesh of the
# device the unit computes on (as FSDP2's offloaded DTensors are): a CPU mesh over an NCCL
# group would send host tensors into NCCL. `full_tensor()` of such a DTensor needs its local
# part on the mesh's device first (`load_state_dict` moves it there when it must reshard;
# torch.distributed.checkpoint reads the local part as it is). Tested on the meta test device
# (tests/unit/test_device_harness.py); NCCL itself needs 2 GPUs.


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict()`` speak DTensors for its unit's parameters."""
    module.register_state_dict_post_hook(_to_dtensors)
    module.register_load_state_dict_pre_hook(_from_dtensors_or_full)


def _keys(module: nn.Module, unit: Unit, prefix: str, full: bool = False) -> list[tuple[str, ShardedParam]]:
    """(state_dict key, parameter) for every registration of the unit's parameters under
    ``module`` where the chunk is registered now (``full``: where the full tensor is, as inside
    summon_full_params or while the unit computes; ``state_dict()`` then holds full tensors)."""
    paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
    out = []
    for sp in unit.params:
        for m, name in sp.uses:
            if id(m) in paths and m._parameters.get(name) is (sp.full if full else sp.sharded):
                path = paths[id(m)]
                out.append((f"{prefix}{path}.{name}" if path else f"{prefix}{name}", sp))
    return out


def _mesh(unit: Unit, device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(unit.group, device.type)


def as_dtensor(sp: ShardedParam, unit: Unit, local: torch.Tensor) -> DTensor:
    """The DTensor whose local part on this rank is ``local``, the chunk of ``sp``, on a mesh
    of the unit's compute device (the full parameter's), wherever ``local`` lives."""
    compute = sp.full.device
    mesh = _mesh(unit, compute)
    if len(sp.shape) == 0:  # one row: rank 0 holds it, the others add zero
        value = local.reshape(()) if local.numel() else torch.zeros((), dtype=local.dtype, device=local.device)
        placements: list[Placement] = [Partial("sum")]
        shape = torch.Size(())
    else:
        value, placements, shape = local, [Shard(0)], torch.Size(sp.shape)
    stride = torch.empty(shape, device="meta").stride()
    if value.device.type == compute.type:
        return DTensor.from_local(value, mesh, placements, run_check=False, shape=shape, stride=stride)
    # from_local would move a host chunk to the mesh's device: the spec goes around it as it is
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, value.dtype))
    return DTensor(value, spec, requires_grad=False)


def _full(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, its local part first moved to the mesh's device (an offloaded
    shard's host chunk: See [Note: state_dict of a sharded model])."""
    local = value.to_local()
    if local.device.type != value.device_mesh.device_type:
        device = torch.device(value.device_mesh.device_type)
        if device.type != "meta" and hasattr(torch, device.type):
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        value = DTensor(moved(local, device), value._spec, requires_grad=False)
    return value.full_tensor()


def _to_dtensors(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    unit = cast(Unit, module._memfit_unit)
    for key, sp in _keys(module, unit, prefix):
        value = state_dict.get(key)
        if value is None or value is sp.sharded or isinstance(value, DTensor):  # keep_vars=True, or done
            continue
        state_dict[key] = as_dtensor(sp, unit, value)


def _from_dtensors_or_full(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing, unexpected, errors
) -> None:
    unit = cast(Unit, module._memfit_unit)
    for key, _ in _keys(module, unit, prefix, full=True):
        if isinstance(state_dict.get(key), DTensor):
            state_dict[key] = _full(state_dict[key])
    for key, sp in _keys(module, unit, prefix):
        value = state_dict.get(key)
        if value is None:
            continue
        if isinstance(value, DTensor):
            same = value.placements == (Shard(0),) and value.device_mesh.size() == unit.world
            if same and tuple(value.to_local().shape) == tuple(sp.sharded.shape):
                state_dict[key] = value.to_local()
                continue
            value = _full(value)
        if tuple(value.shape) != tuple(sp.shape):
            chunk = tuple(value.shape) == tuple(sp.sharded.shape)
            errors.append(
                f"memfit sharding: '{key}' has shape {tuple(value.shape)}, the parameter {tuple(sp.shape)}"
                + (
                    " (the shape of this rank's chunk: load a state dict of DTensors or of full tensors)"
                    if chunk
                    else ""
                )
            )
            state_dict.pop(key)
            continue
        start = min(unit.rank * sp.chunk_rows, sp.rows)
        rows = value.detach().reshape(sp.rows, sp.row_numel)[start : start + sp.local_rows]
        state_dict[key] = rows.reshape(sp.sharded.shape)
