"""`memfit.shard` and `memfit.FullyShardedDataParallel`: fully sharded data parallel (ZeRO-3)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memfit._persist._export import SavePretrained
from memfit._select import resolve
from memfit._shard import _runtime
from memfit._shard._deferred import materialize
from memfit._shard._device import compute_device, resolved
from memfit._shard._fsdp1 import FSDP1API
from memfit._shard._init import (
    broadcast_buffers,
    check_adopted_homes,
    check_one_device_and_dtype,
    claim_parameters,
    ensure_optimizer_check,
    install_outside_hooks,
    managed_modules,
    new_unit,
    place_buffers,
    post_order,
    pre_forward_with_lazy_init,
    shard_parameters,
    wrap_selector,
)
from memfit._shard._layout import Layout, layout_of
from memfit._shard._options import ShardOptions
from memfit._shard._state_dict import install_state_dict_hooks
from memfit._shard._unit import ShardedModule, Unit, user_class

__all__ = ["FullyShardedDataParallel", "shard"]


class FullyShardedDataParallel(FSDP1API, ShardedModule):
    """Drop-in for ``DistributedDataParallel`` that shards the model over the ranks (ZeRO-3).

    ``FullyShardedDataParallel(model, ...)`` shards, in place, each submodule that
    ``auto_wrap_policy`` selects (innermost first), then ``model`` itself with the parameters
    left, and returns ``model`` itself, not a wrapper: its class is extended, so
    ``isinstance(model, FullyShardedDataParallel)`` holds and ``model.no_sync()`` works, while
    ``state_dict()`` keys and parameter names stay unchanged. ``model.module`` (DDP's wrapper)
    is not there: there is no wrapper to unwrap (HF's ``unwrap_model`` and Accelerate stop at the
    model). Build the optimizer afterwards, from ``model.parameters()``.

    Args:
        module: the model to shard; it is returned.
        options: a :class:`ShardOptions`: ``auto_wrap_policy`` (which submodules become their
            own unit), the process group or mesh, ``reshard_after_forward``, the compute
            ``device``, ``mixed_precision``, ``offload``, ... (default: ``ShardOptions()``).
        **kwargs: any field of :class:`ShardOptions` (it replaces that field of ``options``),
            or torch FSDP's and FairScale's spellings, so that only the import changes
            (``sharding_strategy``, ``process_group``, ``device_mesh``, ``device_id``,
            ``cpu_offload``, ``use_orig_params``, FairScale's ``mixed_precision=True``, ...:
            see :meth:`ShardOptions.from_kwargs`).

    Each unit is made by :func:`shard`.
    """

    def __new__(cls, module: nn.Module, *, options: ShardOptions | None = None, **kwargs) -> FullyShardedDataParallel:
        """Shard ``module`` as described in the class docstring and return it."""
        options = ShardOptions.from_kwargs(options, **kwargs)  # once: one mesh for every unit
        unit = dataclasses.replace(options, auto_wrap_policy=None, param_init_fn=None)
        select = wrap_selector(resolve(options.auto_wrap_policy, module))
        for sub in post_order(module):
            if sub is not module and select(sub):
                shard(sub, options=unit)
        shard(module, options=unit)
        module.__class__ = _extended_class(type(module), FullyShardedDataParallel)
        if options.param_init_fn is not None:  # See [Note: What materialize initialises]
            materialize(module, init=options.param_init_fn)
        return module  # type: ignore[return-value]

    def __init__(self, *args, **kwargs) -> None:
        """Nothing to do: ``__new__`` returned the model, already sharded."""


_CLASSES: dict[tuple[type, type], type] = {}  # process-wide: one mixin class per user class, reused


def _is_pretrained_model(cls: type) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in cls.__mro__)


def _extended_class(base: type, mixin: type) -> type:
    """``base`` with ``mixin`` mixed in (one class per pair, made once)."""
    if issubclass(base, mixin):
        return base
    key = (base, mixin)
    if key not in _CLASSES:
        if issubclass(base, ShardedModule):  # FSDP over a module shard() already extended
            base = next(c for c in base.__mro__ if not issubclass(c, ShardedModule))
        # HF models: save_pretrained writes the full weights (See [Note: Exported weights])
        extra = (SavePretrained,) if _is_pretrained_model(base) else ()
        mixins = tuple(c for c in (mixin, *extra) if not any(o is not c and issubclass(o, c) for o in extra))
        _CLASSES[key] = type(f"{mixin.__name__}{base.__name__}", (*mixins, base), {})
    return _CLASSES[key]


# -- shard() ---------------------------------------------------------------------------------


def shard(module: nn.Module, *, options: ShardOptions | None = None, **kwargs) -> nn.Module:
    """Shard ``module``'s parameters over the ranks of the process group, in place (ZeRO-3).

    Each parameter becomes this rank's dim-0 chunk (torch.chunk semantics: uneven and empty
    chunks are fine) and stays a real ``nn.Parameter`` under its original name, so optimizers,
    param groups and frozen parameters work as usual; build the optimizer after sharding. The
    unit's full parameters exist only while it computes: gathered before its forward (and
    again for its backward), freed after, gradients reduce-scattered into the shards.
    Apply bottom-up: blocks first, then the root, whose parameters are the rest. A parameter
    that requires grad but is never used keeps ``grad = None``, as without sharding.

    Args:
        options: a :class:`ShardOptions`: the process group (``group``) or ``mesh`` (hybrid
            sharding), ``reshard_after_forward``, ``sync_module_states``, the compute
            ``device``, ``mixed_precision``, ``offload``, ``param_init_fn`` (default:
            ``ShardOptions()``).
        **kwargs: any field of :class:`ShardOptions` (it replaces that field of ``options``;
            ``shard(m, reshard_after_forward=False)`` is ``shard(m, options=ShardOptions(
            reshard_after_forward=False))``), or torch FSDP's spellings of them.

    Ranks that diverge (one skips or reorders a unit's forward) fail with an error naming the
    rank and the unit: every collective carries the unit's index, and those indices are checked
    once per step, at the end of backward (the step's one host sync), or after each collective
    with the environment variable ``MEMFIT_DEBUG_COLLECTIVES=1``. Ranks whose collectives
    never meet fail after the process group's timeout.
    """
    opts = ShardOptions.from_kwargs(options, **kwargs)
    if opts.auto_wrap_policy is not None:
        raise ValueError(
            "memfit.shard: shards one module and takes no auto_wrap_policy; shard the submodules first, or use "
            "memfit.FullyShardedDataParallel(model, auto_wrap_policy=...)"
        )
    layout = _checked_layout(module, opts.group, opts.mesh)
    managed = managed_modules(module)
    owned = claim_parameters(module, managed, opts.ignored_params)
    compute, host = _devices(opts.device, check_one_device_and_dtype(module, owned), opts.offload, layout.shard)
    check_adopted_homes(module, owned, compute, host)
    place_buffers(managed, compute)  # See [Note: Devices and the meta test device]
    if opts.sync_module_states:
        broadcast_buffers(managed, layout)
    mp = opts.mixed_precision
    if mp is not None:
        mp.prepare([m for _, m in managed])
    params = shard_parameters(owned, layout, compute, mp, host, opts.sync_module_states)
    unit = new_unit(module, params, owned, managed, layout, opts.reshard_after_forward, mp)
    ensure_optimizer_check()
    _install(module, unit)  # See [Note: One sharded training step]
    if opts.param_init_fn is not None:  # See [Note: What materialize initialises]
        materialize(module, init=opts.param_init_fn)
    return module


def _checked_layout(module: nn.Module, group, mesh: DeviceMesh | None) -> Layout:
    """The process groups to shard over; refuses a missing one, and a module sharded already."""
    if group is None and mesh is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "memfit.shard: no process group. Call torch.distributed.init_process_group(...) first "
            "(torchrun sets up the environment for it), or pass group=."
        )
    if isinstance(module, ShardedModule):
        raise ValueError(
            f"memfit.shard: {user_class(module).__name__} is already sharded (its unit is "
            f"'{module._memfit_unit.name}'); shard each module once, bottom-up."
        )
    return layout_of(group, mesh, "memfit.shard")


def _devices(
    device: torch.device | None, found: torch.device | None, offload: str | None, group
) -> tuple[torch.device, torch.device | None]:
    """The device the unit computes on, and the device its shards live on when offloaded:
    ``device``, else the accelerator the parameters are on, else the process group's device
    (NCCL: the current CUDA device; gloo: the CPU), as FSDP2 does."""
    if device is not None:
        compute = resolved(device)  # with its index; refused if this process lacks it
    elif found is not None and found.type != "cpu":
        compute = found
    else:
        compute = compute_device(group)
    return compute, torch.device("cpu") if offload == "cpu" else None


def _install(module: nn.Module, unit: Unit) -> None:
    """Attach ``unit`` to ``module``: its class gains the sharded controls, its forward the hooks."""
    module._memfit_unit = unit  # type: ignore[assignment]  # a Unit, not a Tensor or Module
    module.__class__ = _extended_class(type(module), ShardedModule)
    install_state_dict_hooks(module)  # See [Note: state_dict of a sharded model]
    module.register_forward_pre_hook(pre_forward_with_lazy_init, with_kwargs=True)
    module.register_forward_hook(_runtime.post_forward, with_kwargs=True)
    install_outside_hooks(unit)  # See [Note: A unit's module called outside its forward]
