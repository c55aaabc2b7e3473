"""`memfit.shard` and `memfit.FullyShardedDataParallel`: fully sharded data parallel (ZeRO-3).

# [Note: Units, roots and tied parameters]
# `shard(module)` makes `module` a unit: it owns the parameters registered in its subtree that
# no unit sharded before it (apply it bottom-up: blocks, then the root). A parameter shared by
# several modules (an input embedding tied to the LM head) belongs to the lowest unit that
# contains all its uses: when a later `shard()` finds a parameter an earlier unit owns also
# registered outside that unit, it takes it over. The outermost unit is the root; at its first
# forward it names every unit by its path, fixes their order (checked in every all-gather,
# so ranks that diverge fail instead of exchanging the wrong data) and refuses parameters still
# shared across units with no common sharded ancestor.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from memfit._shard import _runtime
from memfit._shard._mixed import MixedPrecision
from memfit._shard._param import ShardedParam
from memfit._shard._unit import ShardState, Unit

__all__ = [
    "FullyShardedDataParallel",
    "clip_grad_norm_",
    "load_full_state_dict",
    "materialize",
    "shard",
    "summon_full_params",
]

# Parameters replaced by their shards -> the ShardedParam that replaced them.
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# ShardedParam -> the unit that owns it now (ties move a parameter to an ancestor unit).
_OWNER: weakref.WeakKeyDictionary[ShardedParam, Unit] = weakref.WeakKeyDictionary()


class ShardedModule:
    """Mixed into every sharded module's class: the controls of its unit and those below.

    The module's unit is its ``_memfit_unit`` attribute."""

    def _units_below(self) -> list[Unit]:
        return [m._memfit_unit for m in self.modules() if isinstance(m, ShardedModule)]  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally, without communication; the next synced backward
        reduces the sum (same result as one large batch, more memory meanwhile)."""
        units = self._units_below()
        for u in units:
            u.sync_grads = False
        try:
            yield
        finally:
            for u in units:
                u.sync_grads = True


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


def _user_class(module: nn.Module) -> type:
    """The module's own class, without memfit's mixins."""
    return next(c for c in type(module).__mro__ if not issubclass(c, ShardedModule))


def _post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def _wrap_selector(policy) -> Callable[[nn.Module], bool]:
    if policy is None:
        return lambda m: False
    if isinstance(policy, bool):
        raise TypeError("memfit.FullyShardedDataParallel: auto_wrap_policy must not be a bool")
    if isinstance(policy, int):
        min_params = policy

        def big_enough(m: nn.Module) -> bool:
            return sum(p.numel() for p in m.parameters() if p not in _RETIRED and not _is_shard(p)) >= min_params

        return big_enough
    if isinstance(policy, type):
        return lambda m: isinstance(m, policy)
    if isinstance(policy, (set, frozenset, tuple, list)) and all(isinstance(c, type) for c in policy):
        classes = tuple(policy)
        return lambda m: isinstance(m, classes)
    if callable(policy):
        return policy
    raise TypeError(
        "memfit.FullyShardedDataParallel: auto_wrap_policy must be a module class, a set of classes, "
        f"a callable(module) -> bool or a minimum parameter count; got {policy!r}"
    )


def _is_shard(p: nn.Parameter) -> bool:
    return any(sp.sharded is p for sp in _OWNER)


# -- shard() ---------------------------------------------------------------------------------


def _units_directly_below(module: nn.Module) -> list[nn.Module]:
    """Sharded modules under ``module`` not inside another sharded module under it."""
    found = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, ShardedModule):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def _managed_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) for ``module`` and its descendants outside sharded submodules."""
    out = [("", module)]

    def visit(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            if isinstance(child, ShardedModule):
                continue
            path = f"{prefix}{name}"
            out.append((path, child))
            visit(path + ".", child)

    visit("", module)
    return out


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
            f"memfit.shard: {_user_class(module).__name__} is already sharded (its unit is "
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


def _adopt(sp: ShardedParam, owner: Unit, uses: list[tuple[nn.Module, str]]) -> None:
    owner.params.remove(sp)
    sp.uses.extend(uses)
    sp.register(sp.sharded)


def _all_sharded_below(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, ShardedModule) and m is not module]


# -- lazy root initialisation ----------------------------------------------------------------


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    unit: Unit = module._memfit_unit
    if unit.root_state is None:
        _init_root(unit)
        deferred = [sp.fqn for u in unit.root_state.units for sp in u.params if sp.deferred]
        if deferred:
            unit.root_state = None
            raise RuntimeError(
                f"memfit sharding: parameters {deferred[:5]} were built on the meta device and have no values; "
                "call memfit.materialize(model) or memfit.load_full_state_dict(model, state_dict) first"
            )
    return _runtime.pre_forward(module, args, kwargs)


def _init_root(unit: Unit) -> None:
    root = unit
    while root.parent is not None:
        root = root.parent
    units = []
    for path, m in root.module.named_modules():
        if isinstance(m, ShardedModule):
            u = m._memfit_unit
            u.name = path or f"<root {_user_class(m).__name__}>"
            u.index = len(units)
            units.append(u)
            if u.pending_ties:
                p, mod, name = u.pending_ties[0]
                raise ValueError(
                    f"memfit sharding: parameter registered as '{name}' in {type(mod).__name__} (unit '{u.name}') is "
                    f"also owned by unit '{_OWNER[_RETIRED[p]].name}'; shard a module that contains both uses."
                )
    state = _runtime.RootState(root, units)
    paths = {id(m): path for path, m in root.module.named_modules()}
    for u in units:
        u.root_state = state
        for sp in u.params:
            module, name = sp.uses[0]
            sp.fqn = f"{paths[id(module)]}.{name}".lstrip(".")
            # A gradient reaching any sharded parameter guarantees the end-of-backward callback,
            # even when no unit output could be hooked.
            if sp.requires_grad:
                sp.full.register_post_accumulate_grad_hook(lambda _p, st=state: _runtime.ensure_finish_queued(st))


# -- optimizer built before sharding ---------------------------------------------------------

_optimizer_hook = None


def _ensure_optimizer_check() -> None:
    global _optimizer_hook  # noqa: PLW0603 (installed once per process)
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _RETIRED:
                raise RuntimeError(
                    f"memfit sharding: {type(optimizer).__name__} holds parameter '{_RETIRED[p].fqn}' as it was "
                    "before sharding; it would update a tensor the model no longer uses. Build the optimizer "
                    "after memfit.shard / FullyShardedDataParallel, from model.parameters()."
                )


# -- whole-model utilities -------------------------------------------------------------------


def _units_of(model: nn.Module) -> list[Unit]:
    units = [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]
    if not units:
        raise ValueError(f"memfit: {type(model).__name__} has no sharded modules (call memfit.shard first)")
    return units


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Clip the gradients of a sharded model by their global norm over all ranks and units.

    Returns the total norm before clipping, the same float on every rank, equal to what
    ``torch.nn.utils.clip_grad_norm_`` returns for the unsharded model.
    """
    units = _units_of(model)
    grads = [sp.sharded.grad for u in units for sp in u.params if sp.sharded.grad is not None]
    group = units[0].group
    norm_type = float(norm_type)
    device = units[0].params[0].sharded.device if units[0].params else torch.device("cpu")
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads if g.numel()), default=torch.tensor(0.0, device=device))
        total = local.to(device=device, dtype=torch.float32).clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total = local.to(device)
        dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    total_f = float(total)
    coef = max_norm / (total_f + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total_f


@contextlib.contextmanager
def summon_full_params(model: nn.Module, writeback: bool = True) -> Iterator[None]:
    """All parameters of a sharded model, full, under their names, inside this context (all
    ranks must enter it). With ``writeback`` changes made to them are written to the shards."""
    units = _units_of(model)
    with torch.no_grad():
        for u in units:
            u.wait_unshard()
    try:
        yield
    finally:
        with torch.no_grad():
            for u in units:
                if writeback and u.shard_state is ShardState.UNSHARDED:
                    for sp in u.params:
                        full = sp.full.detach().reshape(sp.rows, sp.row_numel)
                        start = min(u.rank * sp.chunk_rows, sp.rows)
                        sp.sharded.detach().view(-1).copy_(full[start : start + sp.local_rows].reshape(-1))
                u.reshard()


# -- deferred initialisation -----------------------------------------------------------------


@torch.no_grad()
def materialize(model: nn.Module, init: Callable[[nn.Module], None] | None = None, seed: int = 0) -> nn.Module:
    """Give the parameters built on the meta device their initial values, one unit at a time:
    the unit's full parameters are allocated, ``init(module)`` (default: the module's own
    ``reset_parameters``) runs on each of its modules under the same seed on every rank, each
    rank keeps its rows, and the full parameters are freed. No communication; the peak is the
    local chunks plus one unit in full. Buffers built on the meta device start at zero unless
    ``init`` or ``reset_parameters`` sets them (BatchNorm's do)."""
    for i, unit in enumerate(_units_of(model)):
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
    model, streamed one tensor at a time: rank 0 broadcasts it, every rank keeps its rows. No
    rank holds more than its chunks plus one full tensor beyond what rank 0 already has."""
    units = _units_of(model)
    group = units[0].group
    src = dist.get_global_rank(group, 0)
    shards = {id(sp.sharded): sp for u in units for sp in u.params}
    rank = dist.get_rank(group)
    names = list(model.state_dict(keep_vars=True).items())

    def full_shape(t):
        sp = shards.get(id(t))
        return tuple(sp.shape) if sp is not None else tuple(t.shape)

    problem = None
    if rank == 0:  # checked before any broadcast, and shared, so no rank waits in vain
        missing = [n for n, _ in names if n not in state_dict]
        unexpected = [n for n in state_dict if n not in dict(names)]
        shapes = [
            f"'{n}' is {list(state_dict[n].shape)}, the model has {list(full_shape(t))}"
            for n, t in names
            if n in state_dict and tuple(state_dict[n].shape) != full_shape(t)
        ]
        if missing or unexpected or shapes:
            problem = f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; {'; '.join(shapes[:5])}"
    box = [problem]
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
        buf = state_dict[name].detach().to(t.dtype).clone() if rank == 0 else torch.empty(shape, dtype=t.dtype)
        if rank == 0 and tuple(buf.shape) != tuple(shape):
            raise RuntimeError(
                f"memfit.load_full_state_dict: '{name}' is {list(buf.shape)}, the model has {list(shape)}"
            )
        dist.broadcast(buf, src=src, group=group)
        if sp is not None:
            sp.keep_rows(buf, dist.get_rank(group))
            sp.deferred = False
        else:
            t.copy_(buf)
    return model
