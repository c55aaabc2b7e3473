"""`memfit.shard` and `memfit.FullyShardedDataParallel`: fully sharded data parallel (ZeRO-3)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memfit._shard import _runtime
from memfit._shard._compat import (
    device_of,
    mesh_of,
    mixed_precision_of,
    offload_of,
    strategy_of,
    wrap_policy_of,
)
from memfit._shard._device import compute_device, resolved
from memfit._shard._export import SavePretrained
from memfit._shard._fsdp1 import FSDP1API
from memfit._shard._init import (
    broadcast_buffers,
    check_adopted_homes,
    check_one_device_and_dtype,
    claim_parameters,
    ensure_optimizer_check,
    managed_modules,
    new_unit,
    place_buffers,
    post_order,
    pre_forward_with_lazy_init,
    shard_parameters,
    wrap_selector,
)
from memfit._shard._layout import Layout, layout_of
from memfit._shard._mixed import MixedPrecision
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
        auto_wrap_policy: which submodules become their own unit: a module class, a set or
            tuple of classes, a ``callable(module) -> bool``, or an int: the minimum number of
            (not yet wrapped) parameters for a submodule to become a unit (FairScale's
            size-based policy). None: the whole model is one unit.
        group: the data-parallel process group (default: the default group).
        reshard_after_forward: free each unit's full parameters after its forward and gather
            them again for backward (ZeRO-3); False keeps them from forward to backward
            (ZeRO-2-like: less communication, more memory). The root always keeps them.
        sync_module_states: broadcast parameters and buffers from rank 0 first, so ranks
            start equal.
        device: the compute device (see :func:`shard`; default: the accelerator the
            parameters are on, else the process group's: the current CUDA device with NCCL,
            the CPU with gloo).
        mixed_precision: a :class:`MixedPrecision`: gather and compute in a lower precision,
            while the shards the optimizer updates keep their own dtype (fp32).
        offload: ``"cpu"`` keeps the shards, their gradients and the optimizer state in host
            memory; units gather their full parameters on the compute device.

    torch FSDP's and FairScale's spellings are accepted too, so that only the import changes
    (see [Note: Spellings from torch FSDP and FairScale] in ``_compat.py``):

        auto_wrap_policy: also torch's ``ModuleWrapPolicy`` / ``CustomPolicy`` objects and
            ``functools.partial(transformer_auto_wrap_policy, ...)`` (or any
            ``fn(module, recurse, nonwrapped_numel)``).
        sharding_strategy: ``FULL_SHARD`` (reshard_after_forward=True), ``SHARD_GRAD_OP``
            (False); ``NO_SHARD`` runs as ``SHARD_GRAD_OP``: DDP's numbers with the state
            sharded at rest; ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2``: without resharding)
            shards within each shard group and replicates across them, as ``shard(mesh=<2-D
            mesh>)``: the groups come from ``device_mesh=`` (2-D), from
            ``process_group=(shard_group, replicate_group)``, or else from ``LOCAL_WORLD_SIZE``
            (torchrun sets it: a node's ranks form a shard group). With ``FULL_SHARD`` or
            ``HYBRID_SHARD`` an int ``reshard_after_forward=k`` keeps 1/k after forward.
        device_mesh: torch's 2-D (replicate, shard) mesh for ``HYBRID_SHARD``, or a 1-D mesh.
        mixed_precision: also torch's ``MixedPrecision`` / ``MixedPrecisionPolicy``, or
            FairScale's ``True`` (fp16 compute).
        device_id: move the module to this device (an int: that accelerator) before sharding.
        process_group: torch's name for ``group`` (a pair of groups for ``HYBRID_SHARD``).
        cpu_offload: torch's ``CPUOffload(offload_params=True)``, FairScale's
            ``move_params_to_cpu=True``: ``offload="cpu"``.
        use_orig_params, flatten_parameters: accepted; memfit always keeps the original
            parameters and always communicates one flat buffer per unit.

    Each unit is made by :func:`shard`, which describes these arguments in full.
    """

    def __new__(
        cls,
        module: nn.Module,
        *,
        auto_wrap_policy=None,
        group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool | int | None = None,
        sync_module_states: bool = True,
        device: torch.device | str | None = None,
        mixed_precision=None,
        offload: str | None = None,
        sharding_strategy=None,
        device_id: int | torch.device | str | None = None,
        process_group: dist.ProcessGroup | tuple | None = None,
        device_mesh: DeviceMesh | None = None,
        cpu_offload=None,
        use_orig_params: bool = True,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
    ) -> FullyShardedDataParallel:
        """Shard ``module`` as described in the class docstring and return it."""
        # See [Note: Spellings from torch FSDP and FairScale]
        del use_orig_params, flatten_parameters  # memfit always keeps the original parameters
        if process_group is not None and group is not None and process_group is not group:
            raise ValueError("memfit.FullyShardedDataParallel: pass group= or process_group=, not both")
        if device_id is not None:
            device = _device_for(module, device_of(device_id), device)
        reshard, hybrid = strategy_of(sharding_strategy, reshard_after_forward)
        mesh = mesh_of(group or process_group, device_mesh, hybrid, sharding_strategy)  # one mesh for every unit
        kwargs = {
            "group": None if mesh is not None else group or process_group,
            "mesh": mesh,
            "reshard_after_forward": reshard,
            "sync_module_states": sync_module_states,
            "device": device,
            "mixed_precision": mixed_precision_of(mixed_precision),
            "offload": offload_of(offload, cpu_offload, move_params_to_cpu),
        }
        select = wrap_selector(wrap_policy_of(auto_wrap_policy, module))
        for sub in post_order(module):
            if sub is not module and select(sub):
                shard(sub, **kwargs)
        shard(module, **kwargs)
        module.__class__ = _extended_class(type(module), FullyShardedDataParallel)
        return module  # type: ignore[return-value]

    def __init__(self, *args, **kwargs) -> None:
        """Nothing to do: ``__new__`` returned the model, already sharded."""


_CLASSES: dict[tuple[type, type], type] = {}


def _device_for(module: nn.Module, target: torch.device, device: torch.device | str | None) -> torch.device:
    """torch FSDP's ``device_id``: move the module there (chunks of meta parameters are allocated there)."""
    if device is not None and torch.device(device) != target:
        raise ValueError(f"memfit.FullyShardedDataParallel: device={device} and device_id={target} differ; pass one")
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        module.to(target)
    return target


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


def shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    sync_module_states: bool = True,
    device: torch.device | str | None = None,
    mixed_precision: MixedPrecision | None = None,
    offload: str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the ranks of ``group``, in place (ZeRO-3).

    Each parameter becomes this rank's dim-0 chunk (torch.chunk semantics: uneven and empty
    chunks are fine) and stays a real ``nn.Parameter`` under its original name, so optimizers,
    param groups and frozen parameters work as usual; build the optimizer after sharding. The
    unit's full parameters exist only while it computes: gathered before its forward (and
    again for its backward), freed after, gradients reduce-scattered into the shards.
    Apply bottom-up: blocks first, then the root, whose parameters are the rest. A parameter
    that requires grad but is never used keeps ``grad = None``, as without sharding.

    Args:
        group: the data-parallel process group (default: the default group).
        mesh: instead of ``group``, a ``DeviceMesh`` (``torch.distributed.device_mesh.
            init_device_mesh``): 1-D, shard over it; 2-D (replicate, shard), hybrid sharding
            (HSDP): parameters, gradients and optimizer state are sharded over each row (the
            shard dimension, usually a node's GPUs), which all-gathers and reduce-scatters
            among itself; the rows hold the same shards, and each rank's reduced gradient shard
            is all-reduced across the replicate dimension, so only 1/shard_size of the
            gradients crosses it (see [Note: Hybrid sharding] in ``_layout.py``).
        reshard_after_forward: free the full parameters after forward and gather them again
            for backward (ZeRO-3); False keeps them from forward to backward (ZeRO-2-like:
            less communication, more memory). The root always keeps them. An int k dividing
            the shard group's size S (FSDP2's int, ZeRO++'s hpZ): keep 1/k of them after
            forward, so that backward gathers over k consecutive ranks only (a node) instead
            of S (see [Note: Partial reshard after forward] in ``_layout.py``).
        sync_module_states: broadcast parameters and buffers from rank 0 first (of all ranks
            of the mesh, when hybrid), so ranks start equal.
        device: the compute device: full parameters, buffers, collectives and the chunks
            (unless offloaded) live there. Default: the accelerator the parameters are on,
            else the process group's device (the current CUDA device with NCCL, as torchrun's
            LOCAL_RANK setup makes it; the CPU with gloo), as FSDP2 does. Parameters and
            buffers built elsewhere are moved there (each parameter's chunk only: the full
            parameter is not). Chunks of parameters built on the meta device are allocated
            there; fill them with :func:`materialize` or :func:`load_full_state_dict`, so the
            full model never exists on one rank (deferred initialisation).
        mixed_precision: a :class:`MixedPrecision`: gather and compute in a lower precision,
            while the shards the optimizer updates keep their own dtype (fp32).
        offload: ``"cpu"`` keeps the shards, their gradients and so the optimizer state in host
            memory (the optimizer steps on the CPU); a unit's full parameters are gathered on
            the compute device (``device``) for its forward and backward,
            and gradients come back to the host after the reduce-scatter. With an accelerator
            that saves its memory; on a CPU-only machine the compute device is the CPU too, so
            the copies are host-to-host: the logic is tested here, the savings need a GPU.

    Ranks that diverge (one skips or reorders a unit's forward) fail with an error naming the
    rank and the unit: every collective carries the unit's index, and those indices are checked
    once per step, at the end of backward (the step's one host sync), or after each collective
    with the environment variable ``MEMFIT_DEBUG_COLLECTIVES=1``. Ranks whose collectives
    never meet fail after the process group's timeout.
    """
    layout = _checked_layout(module, group, mesh)
    managed = managed_modules(module)
    owned = claim_parameters(module, managed)
    compute, host = _devices(device, check_one_device_and_dtype(module, owned), offload, layout.shard)
    check_adopted_homes(module, owned, compute, host)
    place_buffers(managed, compute)  # See [Note: Devices and the meta test device]
    if sync_module_states:
        broadcast_buffers(managed, layout)
    if mixed_precision is not None:
        mixed_precision.prepare([m for _, m in managed])
    params = shard_parameters(owned, layout, compute, mixed_precision, host, sync_module_states)
    unit = new_unit(module, params, owned, managed, layout, reshard_after_forward, mixed_precision)
    ensure_optimizer_check()
    _install(module, unit)  # See [Note: One sharded training step]
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
    device: torch.device | str | None, found: torch.device | None, offload: str | None, group
) -> tuple[torch.device, torch.device | None]:
    """The device the unit computes on, and the device its shards live on when offloaded:
    ``device``, else the accelerator the parameters are on, else the process group's device
    (NCCL: the current CUDA device; gloo: the CPU), as FSDP2 does."""
    if offload not in (None, "cpu"):
        raise ValueError(f"memfit.shard: offload must be None or 'cpu', got {offload!r}")
    if device is not None:
        compute = resolved(device)  # with its index; refused if this process lacks it
    elif found is not None and found.type != "cpu":
        compute = found
    else:
        compute = compute_device(group)
    return compute, torch.device("cpu") if offload == "cpu" else None


def _install(module: nn.Module, unit: Unit) -> None:
    """Attach ``unit`` to ``module``: its class gains the sharded controls, its forward the hooks."""
    module._memfit_unit = unit
    module.__class__ = _extended_class(type(module), ShardedModule)
    install_state_dict_hooks(module)  # See [Note: state_dict of a sharded model]
    module.register_forward_pre_hook(pre_forward_with_lazy_init, with_kwargs=True)
    module.register_forward_hook(_runtime.post_forward, with_kwargs=True)
