"""Whole-model utilities for a sharded model: gradient clipping and the full parameters."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard._device import device_of_units, fill, host_read, same_device
from memfit._shard._unit import ShardState, units_of

__all__ = ["clip_grad_norm_", "summon_full_params"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Clip the gradients of a sharded model by their global norm over all ranks and units.

    Returns the total norm before clipping, the same float on every rank, equal to what
    ``torch.nn.utils.clip_grad_norm_`` returns for the unsharded model. The norm is reduced
    on the compute device (where NCCL takes it, even when the shards are offloaded) and read
    on the host once, to return it: the call's one host sync (the inf-norm included).
    :func:`clip_grad_norm_tensor` clips without reading anything (offloaded shards aside).
    """
    read = clip_grads(model, max_norm, norm_type, read=True)[1]
    return float("nan") if read is None else read  # the meta test device has no values


def clip_grad_norm_tensor(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """As torch FSDP1's method: :func:`clip_grads`' norm on the gradients' device (the compute
    device when they have several or none), in the dtype their dtypes promote to (fp32 when
    this rank has none)."""
    units = units_of(model)
    dtypes = {sp.sharded.grad.dtype for u in units for sp in u.params if sp.sharded.grad is not None}
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32  # once per dtype
    return clip_grads(model, max_norm, norm_type)[0].to(dtype)


@torch.no_grad()
def clip_grads(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, read: bool = False
) -> tuple[torch.Tensor, float | None]:
    """:func:`clip_grad_norm_` without the host read, as ``torch.nn.utils.clip_grad_norm_``:
    the gradients are multiplied by min(1, max_norm / (norm + 1e-6)) on the device (by exactly
    1 when they are within the norm), so nothing waits for the device. Returns the norm on the
    compute device, in fp32 (fp64 where a gradient is), and its value where it was read, once:
    when ``read``, or to clip gradients of offloaded shards, in host memory, on the host (None:
    not read; the meta test device's too). The gradients are read as plain tensors, this rank's
    rows (See [Note: Sharded gradients and torch's clip_grad_norm_]): reduced here, once."""
    with torch._C.DisableTorchFunctionSubclass():
        return _clip_grads(model, max_norm, norm_type, read)


def _clip_grads(model: nn.Module, max_norm: float, norm_type: float, read: bool) -> tuple[torch.Tensor, float | None]:
    units = units_of(model)
    for u in units:  # See [Note: The host step]
        if u.host_step is not None:
            u.host_step.check_clip(u)
    grads = [sp.sharded.grad for u in units for sp in u.params if sp.sharded.grad is not None]
    counted = [g for u in units if _counts(u) for sp in u.params if (g := sp.sharded.grad) is not None]
    group = _norm_group(units)
    norm_type = float(norm_type)
    device = device_of_units(units)  # See [Note: Devices and the meta test device]
    # One _foreach_norm per (device, dtype) group, as torch.nn.utils.clip_grad_norm_: a few ops
    # whatever the number of gradients. 16-bit gradients' norms in fp32; the ranks' parts summed
    # as norm ** p (the max for the inf-norm).
    wide = torch.float64 if any(g.dtype == torch.float64 for g in counted) else torch.float32
    parts = []
    runs = _disk_runs(units, [g for g in counted if g.numel()])  # See [Note: The disk tier]
    for part in _by_device([g for g in counted if g.numel()]):  # (an empty shard adds nothing)
        dtype = None if part[0].dtype in (torch.float32, torch.float64) else torch.float32
        if runs is None:
            norms = torch.stack(torch._foreach_norm(part, norm_type, dtype=dtype))
        else:  # the same norms of the same tensors in the same order, a unit's at a time: the same stack
            norms = torch.stack([n for gs, drop in runs for n in _read(gs, norm_type, dtype, drop)])
        local = norms.amax() if norm_type == float("inf") else norms.to(wide).pow(norm_type).sum()
        parts.append(local.to(device=device, dtype=wide))
    total = torch.stack(parts) if parts else torch.zeros(1, dtype=wide, device=device)
    if norm_type == float("inf"):
        total = total.amax()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = total.sum()
        dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    # The coefficient in double, then in the gradients' wide dtype: what multiplying by the
    # Python float max_norm / (norm + 1e-6) gives (fp64 where the device has it).
    coef_dtype = torch.float32 if total.device.type == "mps" else torch.float64
    coef = (max_norm / (total.to(coef_dtype) + 1e-6)).clamp(max=1.0).to(wide)
    groups = _by_device(grads)
    value = host_read(total) if read or any(not same_device(g[0].device, coef.device) for g in groups) else None
    mul = _disk_runs(units, grads)
    if mul is not None:  # as below, a unit's gradients at a time (See [Note: The disk tier])
        on_coef = same_device(grads[0].device, coef.device)
        factor = coef if on_coef else max_norm / (cast(float, value) + 1e-6)
        for gs, drop in mul:
            if on_coef or not factor >= 1.0:
                torch._foreach_mul_(gs, factor)
            drop(dirty=True)
        return total, value
    for part in groups:
        if same_device(part[0].device, coef.device):
            torch._foreach_mul_(part, coef)
        elif value is not None and not (coef_host := max_norm / (value + 1e-6)) >= 1.0:  # offloaded:
            torch._foreach_mul_(part, coef_host)  # the host clips them (by NaN too, as the device)
    return total, value


def _disk_runs(units: list, grads: list[torch.Tensor]) -> list | None:
    """``grads`` (in their order) in runs of one unit each, each with the call that drops that
    unit's gradient file from memory once the run is read (See [Note: The disk tier]); None
    unless a unit's gradients are on the disk tier and every gradient is on one device."""
    disks = [u.host_step.disk for u in units if u.host_step is not None and u.host_step.disk is not None]
    if not disks or len(_by_device(grads)) != 1:
        return None
    files = {u: d.grad_files[u] for d in disks for u in d.grad_files}
    runs: list[tuple[list[torch.Tensor], object]] = []
    owner: object = None
    for g in grads:
        file = next((f for f in files.values() if f.holds(g)), None) if g.numel() else None
        if file is None or file is not owner:
            runs.append(([], _dropper(file)))
            owner = file
        runs[-1][0].append(g)
    return runs


def _read(grads: list[torch.Tensor], norm_type: float, dtype, drop) -> list[torch.Tensor]:
    norms = list(torch._foreach_norm(grads, norm_type, dtype=dtype))
    drop()
    return norms


def _dropper(file):
    def drop(dirty: bool = False) -> tuple:
        if file is not None:
            file.release(dirty=dirty)
        return ()

    return drop


def _counts(unit) -> bool:
    """Whether this rank adds ``unit``'s gradient shards to the norm: under hybrid sharding the
    replicas hold the same shards, so only the first replica's count (See [Note: Hybrid sharding])."""
    return unit.layout.replicate is None or dist.get_rank(unit.layout.replicate) == 0


def _norm_group(units: list) -> dist.ProcessGroup:
    """Every data-parallel rank, over which the norm is reduced; the same for every unit (units
    sharded over different groups or meshes in one model may mix: a plain unit's shard group is
    all of them, a hybrid unit's is one row of its mesh)."""
    groups = {tuple(dist.get_process_group_ranks(u.layout.everyone)): u.layout.everyone for u in units}
    if len(groups) > 1:
        raise ValueError(
            "memfit.clip_grad_norm_: the model's units are sharded over different sets of ranks "
            f"({sorted(groups)}); shard every unit over the same ranks (one group, or one mesh)"
        )
    return next(iter(groups.values()))


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device and dtype, in order (offloaded and on-device units, and
    mixed precision's fp32 norms beside 16-bit layers, can mix): foreach ops' fast path."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


@contextlib.contextmanager
def summon_full_params(
    model: nn.Module, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False
) -> Iterator[None]:
    """All parameters of a sharded model, full, under their names, inside this context (all
    ranks must enter it). With ``writeback`` changes made to them are written to the shards.

    torch FSDP1's memory savings: ``rank0_only``, only rank 0 (of each shard group) holds them;
    the other ranks gather a unit at a time (rank 0 needs them to) and keep their shards
    inside; ``offload_to_cpu``, they are host copies, gathered on the compute device a unit at
    a time (at most one unit's full parameters there). ``writeback`` with ``rank0_only`` is
    refused, as in FSDP1: the ranks' parameters would differ."""
    if writeback and rank0_only:
        raise NotImplementedError(
            "memfit.summon_full_params: writeback=True with rank0_only=True is not supported (only rank 0 holds "
            "the full parameters, the others could not write theirs back); pass writeback=False"
        )
    units = units_of(model)
    keep = not rank0_only or units[0].rank == 0
    copies: dict[int, list[nn.Parameter]] = {}  # id(unit) -> its parameters' host copies
    with torch.no_grad():
        for u in units:
            u.wait_unshard()
            if keep and offload_to_cpu:
                values = [sp.full.detach().to("cpu", copy=True) for sp in u.params]
                copies[id(u)] = [nn.Parameter(v, sp.full.requires_grad) for v, sp in zip(values, u.params)]
            if not keep or offload_to_cpu:
                u.reshard()
            for sp, host in zip(u.params, copies.get(id(u), ())):
                sp.register(host)
        # A chunk that is its own full parameter (See [Note: One rank computes on its shards])
        # takes writes at once: without writeback its values come back from a copy.
        kept = [] if writeback else [(sp, sp.sharded.detach().clone()) for u in units for sp in u.params if sp.direct]
    try:
        yield
    finally:
        with torch.no_grad():
            for sp, saved in kept:
                sp.sharded.detach().copy_(saved)
            for u in units:
                for sp, host in zip(u.params, copies.get(id(u), ())):
                    if writeback:
                        sp.keep_rows(host, u.rank)
                    sp.register(sp.sharded)
                if writeback and u.shard_state is ShardState.UNSHARDED:
                    for sp in u.params:
                        full = sp.full.detach().reshape(sp.rows, sp.row_numel)
                        start = min(u.rank * sp.chunk_rows, sp.rows)
                        fill(sp.sharded.detach().view(-1), full[start : start + sp.local_rows].reshape(-1))
                u.reshard()
