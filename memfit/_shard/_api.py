"""`memfit.shard` and `memfit.FullyShardedDataParallel`: fully sharded data parallel (ZeRO-3)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard import _runtime
from memfit._shard._init import (
    _OWNER,
    _RETIRED,
    _adopt,
    _all_sharded_below,
    _ensure_optimizer_check,
    _is_shard,
    _managed_modules,
    _post_order,
    _pre_forward,
    _units_directly_below,
    _wrap_selector,
)
from memfit._shard._mixed import MixedPrecision
from memfit._shard._param import ShardedParam
from memfit._shard._unit import ShardedModule, Unit, user_class

__all__ = ["FullyShardedDataParallel", "shard"]


class FullyShardedDataParallel(ShardedModule):
    """Drop-in for ``DistributedDataParallel``: ``FullyShardedDataParallel(model, ...)`` shards
    the submodules ``auto_wrap_policy`` selects, then the root, and returns ``model`` itself
    (its class extended with ``no_sync()``), so ``state_dict()`` keys and parameter names are
    unchanged; ``.module`` is the model too, as with DDP.

    Args:
        auto_wrap_policy: which submodules become their own unit: a module class, a set or
            tuple of classes, a ``callable(module) -> bool``, or an int: the minimum number of
            (not yet wrapped) parameters for a submodule to become a unit (FairScale's
            size-based policy). None: the whole model is one unit.
        group, reshard_after_forward, sync_module_states, device, mixed_precision, offload: as
            for :func:`shard`.
    """

    def __new__(cls, module: nn.Module, **kwargs):
        policy = kwargs.pop("auto_wrap_policy", None)
        select = _wrap_selector(policy)
        for sub in _post_order(module):
            if sub is not module and select(sub):
                shard(sub, **kwargs)
        shard(module, **kwargs)
        module.__class__ = _extended_class(type(module), FullyShardedDataParallel)
        return module

    def __init__(self, *args, **kwargs) -> None:
        pass  # __new__ returned the model itself, already initialised

    @property
    def module(self) -> nn.Module:
        return self  # type: ignore[return-value]


_CLASSES: dict[tuple[type, type], type] = {}


def _extended_class(base: type, mixin: type) -> type:
    if issubclass(base, mixin):
        return base
    key = (base, mixin)
    if key not in _CLASSES:
        if issubclass(base, ShardedModule):  # FSDP over a module shard() already extended
            base = next(c for c in base.__mro__ if not issubclass(c, ShardedModule))
        _CLASSES[key] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})
    return _CLASSES[key]


# -- shard() ---------------------------------------------------------------------------------


def shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    sync_module_states: bool = True,
    device: torch.device | str | None = None,
    mixed_precision: MixedPrecision | None = None,
    offload: str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the ranks of ``group``, in place (ZeRO-3).

    Each parameter becomes this rank's dim-0 chunk (torch.chunk semantics: uneven and empty
    chunks are fine) and stays a real ``nn.Parameter`` under its original name, so optimizers,
    param groups and frozen parameters work as usual; build the optimizer after sharding. The
    unit's full parameters exist only while it computes (see [Note: One sharded training step]).
    Apply bottom-up: blocks first, then the root, whose parameters are the rest. A parameter
    that requires grad but is never used keeps ``grad = None``, as without sharding.

    Args:
        group: the data-parallel process group (default: the default group).
        reshard_after_forward: free the full parameters after forward and gather them again
            for backward (ZeRO-3); False keeps them from forward to backward (ZeRO-2-like:
            less communication, more memory). The root always keeps them.
        sync_module_states: broadcast parameters and buffers from rank 0 first, so ranks start
            equal.
        device: where the chunks of parameters built on the meta device are allocated (default
            the CPU); fill them with :func:`materialize` or :func:`load_full_state_dict`, so
            the full model never exists on one rank (deferred initialisation).
        mixed_precision: compute in a lower precision from fp32 shards; see
            [Note: Mixed precision].
        offload: ``"cpu"`` keeps the shards, their gradients and so the optimizer state in host
            memory (the optimizer steps on the CPU); a unit's full parameters are gathered on
            the compute device (``device``, default the module's) for its forward and backward,
            and gradients come back to the host after the reduce-scatter. With an accelerator
            that saves its memory; on a CPU-only machine the compute device is the CPU too, so
            the copies are host-to-host: the logic is tested here, the savings need a GPU.

    Ranks that diverge (one skips or reorders a unit's forward) fail at once when the units
    they exchange differ (every collective carries the unit's index), else after the process
    group's timeout, with an error naming the rank and the unit.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "memfit.shard: no process group. Call torch.distributed.init_process_group(...) first "
            "(torchrun sets up the environment for it), or pass group=."
        )
    if isinstance(module, ShardedModule):
        raise ValueError(
            f"memfit.shard: {user_class(module).__name__} is already sharded (its unit is "
            f"'{module._memfit_unit.name}'); shard each module once, bottom-up."
        )
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    below = _units_directly_below(module)
    managed = _managed_modules(module)

    uses: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    paths: dict[nn.Parameter, str] = {}
    for path, m in managed:
        for name, p in m._parameters.items():
            if p is None:
                continue
            uses.setdefault(p, []).append((m, name))
            paths.setdefault(p, f"{path}.{name}" if path else name)

    adopted: list[ShardedParam] = []  # tied parameters taken over from units below
    pending: list[tuple[nn.Parameter, nn.Module, str]] = []  # tied to a unit outside this module
    new: list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = []
    below_units = [m._memfit_unit for m in _all_sharded_below(module)]
    for p, p_uses in uses.items():
        if p in _RETIRED:  # tied: an earlier unit sharded it, and it is also used here
            sp = _RETIRED[p]
            owner = _OWNER[sp]
            if owner in below_units:
                _adopt(sp, owner, p_uses)
                adopted.append(sp)
            else:  # owned outside this module: a common ancestor must take it (checked at first forward)
                unit_ties = [(p, m, name) for m, name in p_uses]
                pending.extend(unit_ties)
        elif not _is_shard(p):
            new.append((p, p_uses))
    for u in below_units:  # ties between units below, left for a common ancestor: this one
        for tie in list(u.pending_ties):
            p, m, name = tie
            sp = _RETIRED[p]
            owner = _OWNER[sp]
            if owner in below_units:
                if sp not in adopted:
                    _adopt(sp, owner, [])
                    adopted.append(sp)
                sp.uses.append((m, name))
                sp.register(sp.sharded)
                u.pending_ties.remove(tie)

    devices = {p.device for p, _ in new if not p.is_meta} | {sp.sharded.device for sp in adopted}
    if len(devices) > 1:  # needs two real devices: not exercised by the CPU test suite
        by_device = {str(d): [paths[p] for p, _ in new if p.device == d][:3] for d in devices}
        raise ValueError(
            f"memfit.shard: the parameters of {type(module).__name__} live on several devices {by_device}; "
            "move the module to one device first."
        )
    dtypes = {p.dtype for p, _ in new} | {sp.sharded.dtype for sp in adopted}
    if len(dtypes) > 1:
        by_dtype = {str(d): [paths[p] for p, _ in new if p.dtype == d][:3] for d in dtypes}
        raise ValueError(
            f"memfit.shard: the parameters of {type(module).__name__} have several dtypes {by_dtype}; one unit "
            "gathers them in one buffer. Shard the submodules of each dtype separately first, or cast the module."
        )
    if offload not in (None, "cpu"):
        raise ValueError(f"memfit.shard: offload must be None or 'cpu', got {offload!r}")
    target = torch.device(device) if device is not None else next(iter(devices), torch.device("cpu"))
    host = torch.device("cpu") if offload == "cpu" else None
    for _, m in managed:  # buffers built on the meta device: allocated now, filled by materialize
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros_like(b, device=target)
    if sync_module_states and world > 1:
        with torch.no_grad():
            for p, _ in new:
                if not p.is_meta:
                    dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
            for _, m in managed:
                for b in m._buffers.values():
                    if b is not None:
                        dist.broadcast(b, src=dist.get_global_rank(group, 0), group=group)

    if mixed_precision is not None:
        mixed_precision.prepare([m for _, m in managed])
    params = []
    for p, p_uses in new:
        dtype = mixed_precision.compute_dtype(p_uses[0][0]) if mixed_precision else None
        sp = ShardedParam(p, p_uses, paths[p], rank, world, target, dtype, host)
        if host is not None:
            sp.full.data = sp.full.data.to(target)  # computes on the device; storage freed below
            sp.full.untyped_storage().resize_(0)
        _RETIRED[p] = sp
        params.append(sp)
    reduce_dtype = mixed_precision.reduce_dtype if mixed_precision else None
    unit = Unit(module, [*params, *adopted], group, reshard_after_forward, reduce_dtype)
    unit.input_dtype = mixed_precision.param_dtype if mixed_precision else None
    unit.pending_ties = pending
    unit.managed = [m for _, m in managed]  # modules whose parameters this unit owns
    unit.root_state = None
    unit.parent = None
    for sp in unit.params:
        _OWNER[sp] = unit
    for u in below:
        u._memfit_unit.parent = unit
    _ensure_optimizer_check()
    module._memfit_unit = unit
    module.__class__ = _extended_class(type(module), ShardedModule)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_runtime.post_forward, with_kwargs=True)
    return module
