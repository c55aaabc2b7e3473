"""`memfit.fully_shard`: FSDP2's spelling (``torch.distributed.fsdp.fully_shard``) of memfit's sharding."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_map_only

from memfit._shard._api import _extended_class, shard
from memfit._shard._compat import mixed_precision_of
from memfit._shard._options import ShardOptions
from memfit._shard._param import shard_of
from memfit._shard._unit import ShardedModule, Unit, user_class

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]

# [Note: fully_shard on memfit]
# `memfit.fully_shard(module, ...)` is `memfit.shard(module, options=<its arguments as one
# ShardOptions>)`, then the module's class gains FSDPModule, FSDP2's module methods. FSDP2 and
# memfit group parameters the same way: each call makes one unit (FSDP2's parameter group) of
# the parameters in the module's subtree that no earlier call took, so the usual bottom-up calls
# (each block, then the root) make a unit per block and a root unit with the rest, and the
# outermost unit becomes the root at the first forward. The arguments map onto ShardOptions
# (`options_of`; there is no second copy of the options):
#   mesh -> mesh (None: the default group; 2-D: hybrid sharding); reshard_after_forward
#     -> reshard_after_forward (None, FSDP2's default, -> True: memfit's root keeps its
#     parameters from forward to backward whatever the value, as FSDP2 does for None);
#   mp_policy -> mixed_precision with FSDP2's numbers: norm layers compute in param_dtype too
#     (memfit.MixedPrecision's keep_norms_fp32=False), param_dtype None with a reduce_dtype
#     keeps fp32; output_dtype casts the module's floating outputs (a forward hook);
#     cast_forward_inputs=False leaves the inputs as they are;
#   offload_policy -> offload ("cpu" for CPUOffloadPolicy; pin_memory is not read);
#   ignored_params -> ignored_params (left full, unreduced);
#   sync_module_states=False: FSDP2 broadcasts nothing, each rank shards its own values.
# The module methods map onto the units' state: set_requires_gradient_sync is no_sync's
# GradSync (the next synced backward reduces the accumulated sum); set_reshard_after_forward /
# _after_backward set the unit's flags (a unit kept after backward is gathered again if an
# optimizer step changed its shards meanwhile, which FSDP2 leaves to the user);
# set_modules_to_forward_prefetch / _backward_prefetch replace the recorded order's neighbour
# (See [Note: One sharded training step]), from the first step on; set_gradient_divide_factor
# replaces the rank count in the division; unshard / reshard gather and free the unit (not
# recursive, as FSDP2's). set_is_last_backward is accepted and changes nothing: every memfit
# backward finishes its reductions when it ends.
# What differs: parameters stay plain nn.Parameters holding this rank's rows (torch.chunk rows,
# not DTensors), while state_dict() and the optimizer's state_dict() hold DTensors as FSDP2's;
# clip gradients with memfit.clip_grad_norm_ (torch's would see this rank's rows only); buffers
# outside norm layers are cast to param_dtype; fully_shard on a list of modules, a shard_placement_fn
# other than dim 0, and dp_mesh_dims are refused; 0-dim parameters are accepted (FSDP2 refuses them).


_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # FSDP2's defaults
_NO_OFFLOAD = OffloadPolicy()  # FSDP2's default: no offload


class UnshardHandle:
    """What ``module.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather (the
    module's pre-forward also waits for it)."""

    def __init__(self, unit: Unit) -> None:
        self._unit: Unit | None = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_unshard()
            self._unit = None


class FSDPModule(ShardedModule):
    """FSDP2's module methods, mixed into the class of every module :func:`fully_shard` shards."""

    def _units(self, recurse: bool) -> list[Unit]:
        return self._units_below() if recurse else [self._memfit_unit]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit (not those below), in ``param_dtype``; with ``async_op``
        return a handle to wait on instead of waiting."""
        self._memfit_unit.unshard()
        handle = UnshardHandle(self._memfit_unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters (not recursive); the local rows are registered again."""
        self._memfit_unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: later backwards accumulate full gradients locally, without communication;
        True: the next backward reduces their sum (FSDP1's ``no_sync``)."""
        for u in self._units(recurse):
            u.grad_sync = u.grad_sync.leaving_no_sync() if requires_gradient_sync else u.grad_sync.entering_no_sync()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the full parameters after forward (True) or keep them for backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for u in self._units(recurse):
            u.reshard_after_forward = reshard_after_forward
            u.post_forward_group = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the full parameters after backward, so the next forward needs no all-gather
        (gradient accumulation); an optimizer step in between makes the next forward gather again."""
        for u in self._units(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's scripts: every memfit backward finishes its reductions at its end."""
        del is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather ``modules`` as soon as this module's forward gather is done (instead of the
        next module of the recorded order)."""
        self._memfit_unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather ``modules`` as soon as this module's backward gather is done (instead of the
        module that ran before it in forward)."""
        self._memfit_unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the number of ranks."""
        if not factor > 0:
            raise ValueError(f"memfit: set_gradient_divide_factor takes a positive factor, got {factor!r}")
        unit = self._memfit_unit
        world = unit.layout.data_parallel
        if factor != world and unit.layout.replicate is not None and any(p.direct for p in unit.params):
            raise ValueError(
                f"memfit: set_gradient_divide_factor({factor!r}) on {unit.name!r}, replicated over {world} ranks "
                "(shard groups of one rank): its gradients are reduced as DDP reduces them, kept ones included, "
                f"which only a mean over the {world} ranks leaves right. Shard over 2 or more ranks per group, "
                "or leave the factor at the number of ranks."
            )
        unit.divide_factor = float(factor)
        unit._reduce_plans.clear()


def _units_of(modules: Iterable[Any], where: str) -> list[Unit]:
    modules = list(modules)
    odd = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if odd:
        raise ValueError(f"memfit: {where} takes modules memfit.fully_shard sharded; got {odd[:3]}")
    return [m._memfit_unit for m in modules]


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> nn.Module:
    """Shard ``module`` in place as ``torch.distributed.fsdp.fully_shard`` does, and return it.

    Call it bottom-up: on each block, then on the root, which takes the parameters left. The
    module's class gains FSDP2's methods (``unshard``, ``reshard``,
    ``set_requires_gradient_sync``, ``set_reshard_after_forward``, ``set_reshard_after_backward``,
    ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``,
    ``set_gradient_divide_factor``, ``set_is_last_backward``); build the optimizer afterwards.

    Args:
        mesh: a 1-D ``DeviceMesh`` to shard over, or a 2-D (replicate, shard) one (hybrid
            sharding). Default: every rank of the default process group.
        reshard_after_forward: True (None, the default, too): free the full parameters after
            forward; False: keep them for backward; an int k: keep 1/k of them. The root always
            keeps them.
        shard_placement_fn: only one that places every parameter on dim 0 (returns None or
            ``Shard(0)``) is accepted: memfit shards dim 0.
        mp_policy: torch's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``,
            ``output_dtype``, ``cast_forward_inputs``), with FSDP2's numbers.
        offload_policy: torch's ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy()``.
        ignored_params: parameters left full and unsharded on every rank; their gradients are
            not reduced.
        dp_mesh_dims: not supported (None only).

    See [Note: fully_shard on memfit] for what maps onto what, and what differs.
    """
    where = "memfit.fully_shard"
    if isinstance(module, (list, tuple)):
        raise NotImplementedError(
            f"{where}: one call shards one module; grouping several modules in one unit is not supported. "
            "Call fully_shard on each of them, or on a module that contains them."
        )
    if dp_mesh_dims is not None:
        raise NotImplementedError(f"{where}: dp_mesh_dims (an SPMD mesh) is not supported; pass mesh= (1-D or 2-D)")
    _check_placements(module, shard_placement_fn, ignored_params or set(), where)
    options = options_of(mesh, reshard_after_forward, mp_policy, offload_policy, ignored_params)
    shard(module, options=options)
    module.__class__ = _extended_class(type(module), FSDPModule)
    if not mp_policy.cast_forward_inputs:
        cast(FSDPModule, module)._memfit_unit.input_dtype = None
    if mp_policy.output_dtype is not None:
        module.register_forward_hook(_output_cast(mp_policy.output_dtype))
    return module


def options_of(
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: Iterable[nn.Parameter] | None,
) -> ShardOptions:
    """FSDP2's arguments as memfit's one options object (See [Note: fully_shard on memfit])."""
    where = "memfit.fully_shard"
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"{where}: offload_policy must be torch.distributed.fsdp's OffloadPolicy() or CPUOffloadPolicy(), "
            f"got {offload_policy!r}"
        )
    mixed = mixed_precision_of(mp_policy, where)
    if mixed is not None:
        mixed = dataclasses.replace(mixed, keep_norms_fp32=False)
    return ShardOptions.from_kwargs(
        mesh=mesh,
        reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
        sync_module_states=False,
        mixed_precision=mixed,
        offload="cpu" if isinstance(offload_policy, CPUOffloadPolicy) else None,
        ignored_params=frozenset(ignored_params) if ignored_params is not None else frozenset(),
    )


def _check_placements(module: nn.Module, fn: Callable | None, ignored: set, where: str) -> None:
    """Refuse a ``shard_placement_fn`` that places a parameter anywhere but dim 0."""
    if fn is None:
        return
    for name, p in module.named_parameters():
        if p in ignored or shard_of(p) is not None:  # a unit below holds it
            continue
        placement = fn(p)
        if placement is not None and not (isinstance(placement, Shard) and placement.dim == 0):
            raise NotImplementedError(
                f"{where}: shard_placement_fn places {user_class(module).__name__}'s parameter '{name}' on "
                f"{placement!r}; memfit shards every parameter on dim 0 (Shard(0)). Return None or Shard(0), "
                "or leave shard_placement_fn out."
            )


def _output_cast(dtype: torch.dtype) -> Callable:
    def cast_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    return cast_outputs
