"""How a module becomes a unit: the modules and parameters it manages, tied-parameter
ownership, wrap policies, and the root's initialisation at its first forward.

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

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from memfit._shard import _runtime
from memfit._shard._param import ShardedParam
from memfit._shard._unit import ShardedModule, Unit, user_class

# Parameters replaced by their shards -> the ShardedParam that replaced them.
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# ShardedParam -> the unit that owns it now (ties move a parameter to an ancestor unit).
_OWNER: weakref.WeakKeyDictionary[ShardedParam, Unit] = weakref.WeakKeyDictionary()


# -- wrap policies ---------------------------------------------------------------------------


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


# -- managed modules and tied parameters ----------------------------------------------------


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
            u.name = path or f"<root {user_class(m).__name__}>"
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
