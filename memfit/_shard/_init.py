"""How a module becomes a unit: the modules and parameters it manages, tied-parameter
ownership, wrap policies, and the root's initialisation at its first forward.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memfit._select import predicate
from memfit._shard import _runtime
from memfit._shard._device import moved, same_device
from memfit._shard._layout import Layout
from memfit._shard._mixed import MixedPrecision
from memfit._shard._optim_state import install_optimizer_state_hooks, localize_loaded_state
from memfit._shard._param import ShardedParam, shard_of, sharded_as
from memfit._shard._unit import ShardedModule, ShardState, TrainingState, Unit, user_class

# [Note: Units, roots and tied parameters]
# `shard(module)` makes `module` a unit: it owns the parameters registered in its subtree that
# no unit sharded before it (apply it bottom-up: blocks, then the root). A parameter shared by
# several modules (an input embedding tied to the LM head) belongs to the lowest unit that
# contains all its uses: when a later `shard()` finds a parameter an earlier unit owns also
# registered outside that unit, it takes it over. The outermost unit is the root; at its first
# forward it names every unit by its path, fixes their order (checked in every all-gather,
# so ranks that diverge fail instead of exchanging the wrong data) and refuses parameters still
# shared across units with no common sharded ancestor.

# Ownership is kept on the objects: a replaced parameter points to its ShardedParam
# (`sharded_as`), a local chunk to its ShardedParam (`shard_of`), and a ShardedParam to the
# unit that owns it now (`owner`; ties move a parameter to an ancestor unit).


# -- wrap policies ---------------------------------------------------------------------------


def post_order(module: nn.Module) -> list[nn.Module]:
    """``module`` and its descendants, children before parents (the order to shard them in)."""
    out = []
    for child in module.children():
        out.extend(post_order(child))
    out.append(module)
    return out


def wrap_selector(policy) -> Callable[[nn.Module], bool]:
    """The predicate an ``auto_wrap_policy`` stands for: does this submodule become a unit? (See
    [Note: One module-selection policy]; an int counts the parameters no unit below has taken.)"""

    def unsharded(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if sharded_as(p) is None and shard_of(p) is None)

    return predicate(policy, "memfit.FullyShardedDataParallel", "auto_wrap_policy", numel=unsharded)


# -- managed modules and tied parameters ----------------------------------------------------


def managed_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
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


def _units_directly_below(module: nn.Module) -> list[ShardedModule]:
    """Sharded modules under ``module`` not inside another sharded module under it."""
    found: list[ShardedModule] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, ShardedModule):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def _all_sharded_below(module: nn.Module) -> list[ShardedModule]:
    """Every sharded module under ``module``, at any depth."""
    return [m for m in module.modules() if isinstance(m, ShardedModule) and m is not module]


@dataclass
class Ownership:
    """The parameters a new unit takes, found in the modules it manages."""

    paths: dict[nn.Parameter, str]  # each parameter's first registration, relative to the module
    # Parameters no unit has sharded, each with every (module, name) that registers it.
    new: list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = field(default_factory=list)
    adopted: list[ShardedParam] = field(default_factory=list)  # tied parameters taken over from units below
    pending: list[tuple[nn.Parameter, nn.Module, str]] = field(default_factory=list)  # tied to a unit outside


def claim_parameters(
    module: nn.Module, managed: list[tuple[str, nn.Module]], ignored: frozenset[nn.Parameter] = frozenset()
) -> Ownership:
    """Sort the parameters of the managed modules into new ones, ties to adopt, and ties left
    pending; those in ``ignored`` (ShardOptions.ignored_params) stay where they are."""
    # See [Note: Units, roots and tied parameters]
    uses, paths = _parameter_uses(managed)
    owned = Ownership(paths)
    below = [m._memfit_unit for m in _all_sharded_below(module)]
    for p, p_uses in uses.items():
        if p in ignored:
            continue
        sp = sharded_as(p)
        if sp is not None:  # tied: an earlier unit sharded it, and it is also used here
            owner = sp.owner
            if owner is not None and owner in below:
                _adopt(sp, owner, p_uses)
                owned.adopted.append(sp)
            else:  # owned outside this module: a common ancestor must take it (checked at first forward)
                owned.pending.extend((p, m, name) for m, name in p_uses)
        elif shard_of(p) is None:
            owned.new.append((p, p_uses))
    _adopt_ties_between(below, owned.adopted)
    return owned


def _parameter_uses(
    managed: list[tuple[str, nn.Module]],
) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str]]], dict[nn.Parameter, str]]:
    """Every (module, name) that registers each parameter, and the path of its first registration."""
    uses: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    paths: dict[nn.Parameter, str] = {}
    for path, m in managed:
        for name, p in m._parameters.items():
            if p is None:
                continue
            uses.setdefault(p, []).append((m, name))
            paths.setdefault(p, f"{path}.{name}" if path else name)
    return uses, paths


def _adopt(sp: ShardedParam, owner: Unit, uses: list[tuple[nn.Module, str]]) -> None:
    """Take ``sp`` away from ``owner`` and register its chunk in ``uses`` too."""
    owner.forget_param(sp)
    sp.uses.extend(uses)
    sp.register(sp.sharded)


def _adopt_ties_between(below: list[Unit], adopted: list[ShardedParam]) -> None:
    """Take over the ties between units below, which they left pending for a common ancestor."""
    for u in below:
        for tie in list(u.pending_ties):
            p, m, name = tie
            sp = sharded_as(p)
            assert sp is not None  # a pending tie is to a parameter a unit sharded
            owner = sp.owner
            if owner is not None and owner in below:
                if sp not in adopted:
                    _adopt(sp, owner, [])
                    adopted.append(sp)
                sp.uses.append((m, name))
                sp.register(sp.sharded)
                u.pending_ties.remove(tie)


# -- a new unit's parameters and buffers ------------------------------------------------------


def check_one_device_and_dtype(module: nn.Module, owned: Ownership) -> torch.device | None:
    """Refuse parameters on several devices or of several dtypes; return their device (None: all
    on meta). Adopted ties count where their unit computes: the root's own parameters built on
    the host follow them there (See [Note: Devices and the meta test device])."""
    new, paths = owned.new, owned.paths
    devices = {p.device for p, _ in new if not p.is_meta}
    below = {sp.full.device for sp in owned.adopted}
    if below and devices <= {torch.device("cpu")}:
        devices = below
    elif below:
        devices |= below
    if len(devices) > 1:  # needs two real devices: not exercised by the CPU test suite
        by_device = {str(d): [paths[p] for p, _ in new if p.device == d][:3] for d in devices}
        for sp in owned.adopted:
            by_device.setdefault(str(sp.full.device), []).append(f"{sp.fqn} (tied, sharded below)")
        raise ValueError(
            f"memfit.shard: the parameters of {type(module).__name__} live on several devices {by_device}; "
            "move the module to one device first."
        )
    dtypes = {p.dtype for p, _ in new} | {sp.sharded.dtype for sp in owned.adopted}
    if len(dtypes) > 1:
        by_dtype = {str(d): [paths[p] for p, _ in new if p.dtype == d][:3] for d in dtypes}
        raise ValueError(
            f"memfit.shard: the parameters of {type(module).__name__} have several dtypes {by_dtype}; one unit "
            "gathers them in one buffer. Shard the submodules of each dtype separately first, or cast the module."
        )
    return next(iter(devices), None)


def check_adopted_homes(module: nn.Module, owned: Ownership, compute: torch.device, host: torch.device | None) -> None:
    """Refuse tied parameters adopted from units whose shards live elsewhere than this unit's
    (offloaded there and not here, or the reverse): a unit lands its reduced gradients in one
    place, so that tie's gradient would reach the wrong device."""
    home = host or compute
    elsewhere = {id(sp.sharded) for sp in owned.adopted if sp.sharded.device.type != home.type}
    if elsewhere:
        odd = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in elsewhere]
        here = f"offload={'cpu' if host else None}"
        raise ValueError(
            f"memfit.shard: {type(module).__name__} ({here}) takes over tied parameters {odd[:5]} from sharded "
            "submodules whose shards live elsewhere (a different offload); shard the modules sharing a parameter "
            "with the same offload."
        )


def place_buffers(managed: list[tuple[str, nn.Module]], device: torch.device) -> None:
    """Put the managed modules' buffers on the compute ``device``: those built on the meta
    device allocated there, zeroed (materialize fills them), the others moved there."""
    for _, m in managed:
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros_like(b, device=device)
                m.__dict__.setdefault("_memfit_meta_buffers", set()).add(name)  # for materialize to fill
            elif b is not None and not same_device(b.device, device):
                m._buffers[name] = b.to(device)


@torch.no_grad()
def broadcast_buffers(managed: list[tuple[str, nn.Module]], layout: Layout) -> None:
    """Copy rank 0's buffers of the managed modules to every rank of every replica (they are on
    the compute device)."""
    group = layout.everyone
    if dist.get_world_size(group) <= 1:
        return
    for _, m in managed:
        for b in m._buffers.values():
            if b is not None:
                dist.broadcast(b, src=dist.get_global_rank(group, 0), group=group)


@torch.no_grad()
def shard_parameters(
    owned: Ownership,
    layout: Layout,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
    shard_device: torch.device | None,
    sync: bool = False,
) -> list[ShardedParam]:
    """Replace each new parameter, wherever it is registered, by this rank's chunk of it; with
    ``sync``, of rank 0's values (rank 0 of every replica's ranks), broadcast one rank's rows at
    a time on the compute device: a parameter built in host memory is never there in full."""
    # See [Note: Sharded parameter layout] and [Note: Devices and the meta test device]
    rank, world = dist.get_rank(layout.shard), dist.get_world_size(layout.shard)
    everyone = layout.everyone
    params = []
    for p, p_uses in owned.new:
        dtype = mixed_precision.compute_dtype(p_uses[0][0]) if mixed_precision else None
        rows = None
        if sync and dist.get_world_size(everyone) > 1 and not p.is_meta:
            rows = _synced_rows(p.detach(), rank, world, device, everyone)
        params.append(ShardedParam(p, p_uses, owned.paths[p], rank, world, device, dtype, shard_device, rows))
    return params


def _synced_rows(p: torch.Tensor, rank: int, world: int, device: torch.device, group) -> torch.Tensor:
    """This rank's rows of rank 0's ``p`` (rows as [Note: Sharded parameter layout] deals them),
    on ``device``: rank 0 broadcasts each shard rank's rows in turn (W broadcasts of 1/W of the
    parameter: the bytes of one broadcast of it, never more than one rank's rows on the device)."""
    n = p.shape[0] if p.dim() > 0 else 1
    flat = p.reshape(n, math.prod(p.shape[1:]))  # a parameter of 0 rows too (MobileBERT)
    chunk = math.ceil(n / world)
    src = dist.get_global_rank(group, 0)
    mine = None
    for r in range(world):
        part = moved(flat[min(r * chunk, n) : min((r + 1) * chunk, n)], device, copy=True)
        if part.numel():  # every rank knows the shapes: nothing to send for an empty part
            dist.broadcast(part, src=src, group=group)
        if r == rank:
            mine = part
    assert mine is not None
    return mine.reshape((mine.shape[0], *p.shape[1:]) if p.dim() > 0 else (mine.shape[0],))


def new_unit(
    module: nn.Module,
    params: list[ShardedParam],
    owned: Ownership,
    managed: list[tuple[str, nn.Module]],
    layout: Layout,
    reshard_after_forward: bool | int,
    mixed_precision: MixedPrecision | None,
) -> Unit:
    """The unit owning the new and adopted parameters, made the parent of the units directly below."""
    reduce_dtype = mixed_precision.reduce_dtype if mixed_precision else None
    unit = Unit(
        module,
        [*params, *owned.adopted],
        layout,
        reshard_after_forward,
        reduce_dtype,
        input_dtype=mixed_precision.param_dtype if mixed_precision else None,
        managed=[m for _, m in managed],
        pending_ties=owned.pending,
    )
    for below in _units_directly_below(module):
        below._memfit_unit.parent = unit
    return unit


# -- lazy root initialisation ----------------------------------------------------------------


def pre_forward_with_lazy_init(module: nn.Module, args: tuple, kwargs: dict):
    """A unit's forward pre-hook: initialise its root on first use, then run the runtime's pre-forward."""
    unit = cast(Unit, module._memfit_unit)
    if unit.root_state is None:
        _init_root(unit)
        state = cast(_runtime.RootState, unit.root_state)  # _init_root set it
        deferred = [sp.fqn for u in state.units for sp in u.params if sp.deferred]
        if deferred:
            unit.root_state = None
            raise RuntimeError(
                f"memfit sharding: parameters {deferred[:5]} were built on the meta device and have no values; "
                "call memfit.materialize(model) or memfit.load_full_state_dict(model, state_dict) first"
            )
    return cast(_runtime.RootState, unit.root_state).pre_forward(unit, args, kwargs)


# [Note: A unit's module called outside its forward]
# Between its forwards a unit's modules register its local chunks, and its forward hooks gather
# them. Model code may call a module of a unit without the unit's forward: ModernVBERT embeds
# its tokens with `self.text_model.get_input_embeddings()(input_ids)`, the nn.Embedding inside
# the ModernBertEmbeddings unit, before it calls the text model. That call computed on the chunk
# (64 of 128 rows at W=2: nn.Embedding's padding-index check failed; with no padding index,
# other rows' embeddings or an index error). So every module that registers a unit's parameter,
# other than the unit's own module, gets a pre-hook: called while that unit is not
# gathered, the call runs as a call of the unit (the runtime's pre-forward: gather, hook the
# inputs for the post-backward or leave the reduce to the end of backward; its post-forward:
# hook the outputs for the pre-backward, reshard after forward), so the module computes on the
# full parameters and its gradients are reduced with the unit's. Inside the unit's forward the
# unit is gathered and the pre-hook returns at once (a state check per call of such a module);
# the hook after the call is registered by the pre-hook of an outside call, for that call only.
# A unit kept gathered after its backward (reshard_after_backward=False) and stepped since is
# gathered again, as its own forward would. A call that raises leaves its hook after the call
# behind; the module's next call removes it first. Not handled: a parameter read directly
# (`module.weight` outside any module call), and an outside call of a module the root owns
# before the root's first forward, which records the root alone as the forward order (no
# prefetch from then on; the results are the same).


def install_outside_hooks(unit: Unit) -> None:
    """A pre-hook on each module that registers ``unit``'s parameters, other than its own
    module (See [Note: A unit's module called outside its forward])."""
    by_module: dict[nn.Module, list[ShardedParam]] = {}
    for sp in unit.params:
        for m, _ in sp.uses:
            if m is not unit.module and sp not in by_module.setdefault(m, []):
                by_module[m].append(sp)
    for m, sps in by_module.items():
        m.register_forward_pre_hook(functools.partial(_outside_pre_forward, sps, []), with_kwargs=True)


def _outside(sp: ShardedParam) -> bool:
    """Whether ``sp``'s unit must be gathered for a call of one of its modules: not gathered,
    or kept gathered after a backward (reshard_after_backward=False) and stepped since."""
    owner = cast("Unit | None", sp.owner)  # (a tie may have moved the parameter to a unit above since the hook was set)
    # (a direct chunk is the full tensor; with replicas its gradient must still be reduced, so
    # the call runs as a call of the unit)
    if owner is None or (sp.direct and owner.layout.replicate is None):
        return False
    if owner.shard_state is not ShardState.UNSHARDED:
        return True
    if sp.direct:  # "gathered" at once when prefetched: outside the unit's forward unless it runs
        return torch.is_grad_enabled() and owner.training_state in (TrainingState.IDLE, TrainingState.REDUCED)
    return owner.training_state in (TrainingState.IDLE, TrainingState.REDUCED) and owner._stale()


def _outside_pre_forward(sps: list[ShardedParam], pending: list, module: nn.Module, args: tuple, kwargs: dict):
    while pending:  # the hook of an outside call whose forward raised (it never ran)
        pending.pop().remove()
    if not any(_outside(sp) for sp in sps):  # inside the units' forwards: nothing to do
        return None
    units = list(dict.fromkeys(cast(Unit, sp.owner) for sp in sps if _outside(sp)))
    changed = None
    for u in units:
        out = pre_forward_with_lazy_init(u.module, args, kwargs)
        if out is not None:
            changed = args, kwargs = out
    # this call's own post-forward: a hook for this call only (none on the calls inside a unit)
    pending.append(
        module.register_forward_hook(functools.partial(_outside_post_forward, units, pending), with_kwargs=True)
    )
    return changed


def _outside_post_forward(units: list[Unit], pending: list, module: nn.Module, args: tuple, kwargs: dict, output):
    pending.pop().remove()
    for u in reversed(units):
        cast(_runtime.RootState, u.root_state).post_forward(u, output)


def _init_root(unit: Unit) -> None:
    """Name and number every unit under the root above ``unit``, and give them one RootState."""
    # See [Note: Units, roots and tied parameters]
    root = unit
    while root.parent is not None:
        root = root.parent
    units: list[Unit] = []
    for path, m in root.module.named_modules():
        if isinstance(m, ShardedModule):
            u = m._memfit_unit
            u.name = path or f"<root {user_class(m).__name__}>"
            u.index = len(units)
            units.append(u)
            if u.pending_ties:
                p, mod, name = u.pending_ties[0]
                other = cast(ShardedParam, sharded_as(p)).owner  # a pending tie: sharded by another unit
                raise ValueError(
                    f"memfit sharding: parameter registered as '{name}' in {type(mod).__name__} (unit '{u.name}') is "
                    f"also owned by unit '{other.name if other else '?'}'; shard a module that contains both uses."
                )
    state = _runtime.RootState(root, units)
    finish_hook = _finish_hook(state)
    paths = {id(m): path for path, m in root.module.named_modules()}
    for u in units:
        u.root_state = state
        for sp in u.params:
            module, name = sp.uses[0]
            sp.fqn = f"{paths[id(module)]}.{name}".lstrip(".")
            # A gradient reaching any sharded parameter guarantees the end-of-backward callback,
            # even when no unit output could be hooked.
            if sp.requires_grad and sp.full.requires_grad:  # (a chunk that is its own full parameter may be frozen)
                sp.full.register_post_accumulate_grad_hook(finish_hook)


def _finish_hook(state: _runtime.RootState) -> Callable[[torch.Tensor], None]:
    """A sharded parameter's post-accumulate-grad hook, holding the root's state weakly. The
    garbage collector does not see what such a hook holds (torch keeps it in C++), so a strong
    reference (state -> units -> the parameter -> the hook) was a cycle it never freed: every
    sharded model that ran a forward lived, with its process group, until the process ended
    (see [Note: Ending a process group] in memfit/cli/_launch.py)."""
    ref = weakref.ref(state)

    def finish(_param: torch.Tensor) -> None:
        st = ref()
        if st is not None:
            st.ensure_finish_queued()

    return finish


# -- optimizer built before sharding ---------------------------------------------------------

_optimizer_hook = None  # process-wide: torch's optimizer step hooks are global, installed once


def ensure_optimizer_check() -> None:
    """Install, once per process, the check that refuses optimizers built before sharding."""
    global _optimizer_hook  # noqa: PLW0603 (installed once per process)
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: refuse a step on parameters that sharding replaced; give an
    optimizer of sharded parameters its state_dict hooks (See [Note: Optimizer state of a sharded model])."""
    chunks = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            chunks = chunks or shard_of(p) is not None
            if (sp := sharded_as(p)) is not None:
                raise RuntimeError(
                    f"memfit sharding: {type(optimizer).__name__} holds parameter '{sp.fqn}' as it was "
                    "before sharding; it would update a tensor the model no longer uses. Build the optimizer "
                    "after memfit.shard / FullyShardedDataParallel, from model.parameters()."
                )
    if chunks and not getattr(optimizer, "_memfit_state_hooks", False):
        install_optimizer_state_hooks(optimizer)
        localize_loaded_state(optimizer)
