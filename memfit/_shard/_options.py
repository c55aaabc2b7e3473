"""`memfit.ShardOptions`: every sharding option, declared once (See [Note: One options object])."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memfit._select import check
from memfit._shard._compat import (
    check_prefetch,
    device_of,
    ignored_of,
    mesh_of,
    mixed_precision_of,
    offload_of,
    strategy_of,
)
from memfit._shard._mixed import MixedPrecision

__all__ = ["ShardOptions"]

# [Note: One options object]
# Every sharding option is a field of ShardOptions, documented there and validated in its
# __post_init__. The entry points (memfit.shard, memfit.FullyShardedDataParallel, the Lightning
# strategy, the HF Trainer, `memfit train`) take `options=ShardOptions(...)` and, as before, the
# options as keyword arguments: ShardOptions.from_kwargs, the one place keywords become options,
# reads memfit's names and torch FSDP's / FairScale's spellings. The integrations pass their
# keyword arguments through to it unread, so adding an option is one field here (and its use).

# torch FSDP's and FairScale's spellings that from_kwargs maps onto the fields (See [Note:
# Spellings from torch FSDP and FairScale] in _compat.py).
_SPELLINGS = (
    "sharding_strategy",
    "process_group",
    "device_mesh",
    "device_id",
    "cpu_offload",
    "move_params_to_cpu",
    "use_orig_params",
    "flatten_parameters",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "ignored_modules",
    "ignored_states",
)
_MOOT = ("use_orig_params", "flatten_parameters", "backward_prefetch", "forward_prefetch", "limit_all_gathers")


@dataclass(frozen=True)
class ShardOptions:
    """How a model is sharded: one frozen value that ``memfit.shard``,
    ``memfit.FullyShardedDataParallel``, ``MemfitStrategy``, ``MemfitTrainer`` and
    ``memfit train`` all take as ``options=``. Each field can also be passed to them as a
    keyword argument of the same name (see :meth:`from_kwargs`); keywords given beside
    ``options=`` replace those fields.

    Attributes:
        auto_wrap_policy: which submodules ``FullyShardedDataParallel`` shards as their own unit
            (innermost first; the root takes the parameters left): a module class, a set or
            tuple of classes, ``memfit.every_nth(n, classes)``, a ``callable(module) -> bool``, an
            int (the minimum number of not yet wrapped parameters, FairScale's size-based policy),
            or torch's policy objects and old-style policy callables: the same policy
            :func:`memfit.apply_activation_checkpointing` takes. None: the whole model is one unit. ``memfit.shard``
            shards one module and takes none.
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
            while the shards the optimizer updates keep their own dtype (fp32). torch's
            ``MixedPrecision`` / ``MixedPrecisionPolicy`` and FairScale's ``True`` (fp16
            compute) are turned into one.
        offload: ``"cpu"`` keeps the shards, their gradients and so the optimizer state in host
            memory (the optimizer steps on the CPU); a unit's full parameters are gathered on
            the compute device (``device``) for its forward and backward, and gradients come
            back to the host after the reduce-scatter. With an accelerator that saves its
            memory; on a CPU-only machine the compute device is the CPU too, so the copies are
            host-to-host: the logic is tested here, the savings need a GPU.
        param_init_fn: for parameters and buffers built on the meta device (torch FSDP1's
            argument): once sharded, ``memfit.materialize(model, init=param_init_fn)`` gives
            them values, one unit at a time: ``param_init_fn(module)`` is called on every
            module of a unit with deferred tensors, children first, with that unit's full
            parameters allocated, and must fill them in place (``reset_parameters()``, or
            ``to_empty(device=..., recurse=False)`` then an init). Modules with values are
            left alone. None: meta-built tensors wait for :func:`materialize` or
            :func:`load_full_state_dict`.
        ignored_params: parameters left out of sharding (FSDP2's ``ignored_params``): each
            stays a full, plain parameter on every rank, is not moved to the compute device,
            and its gradient is not reduced across ranks (each rank keeps its own; average it
            yourself if the ranks must agree). It applies to the module this call shards, not
            to the units below it. A set, frozenset, list or tuple of ``nn.Parameter``s, kept
            as a frozenset. ``memfit.clip_grad_norm_`` counts the sharded parameters only.
    """

    auto_wrap_policy: Any = None
    group: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None
    reshard_after_forward: bool | int = True
    sync_module_states: bool = True
    device: torch.device | None = None
    mixed_precision: MixedPrecision | None = None
    offload: str | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    ignored_params: frozenset[nn.Parameter] = frozenset()

    def __post_init__(self) -> None:
        where = "memfit.ShardOptions"
        if isinstance(self.group, (tuple, list)):
            raise ValueError(
                f"{where}: group= takes one process group; for a (shard_group, replicate_group) pair pass "
                "mesh=<2-D mesh>, or torch FSDP's sharding_strategy=HYBRID_SHARD with process_group=(shard, replicate)"
            )
        if self.group is not None and self.mesh is not None:
            raise ValueError(f"{where}: pass group= or mesh=, not both")
        if self.mesh is not None and not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {self.mesh!r}")
        raf = self.reshard_after_forward
        if not isinstance(raf, int) or (type(raf) is int and raf < 1):
            raise ValueError(
                f"{where}: reshard_after_forward must be True, False or an int k >= 1 (keep 1/k of the "
                f"parameters after forward), got {raf!r}"
            )
        if not isinstance(self.sync_module_states, bool):
            raise TypeError(f"{where}: sync_module_states must be True or False, got {self.sync_module_states!r}")
        if self.offload not in (None, "cpu"):
            raise ValueError(f"{where}: offload must be None or 'cpu', got {self.offload!r}")
        if self.device is not None and not isinstance(self.device, torch.device):
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError):
                raise ValueError(f"{where}: device={self.device!r} is not a device (e.g. 'cuda:0', 'cpu')") from None
        object.__setattr__(self, "mixed_precision", mixed_precision_of(self.mixed_precision, where))
        object.__setattr__(self, "ignored_params", _ignored(self.ignored_params, where))
        check(self.auto_wrap_policy, where, "auto_wrap_policy")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(f"{where}: param_init_fn must be a callable(module), got {self.param_init_fn!r}")

    @classmethod
    def from_kwargs(cls, options: ShardOptions | None = None, /, **kwargs: Any) -> ShardOptions:
        """``options`` (default: ``ShardOptions()``) with the fields ``kwargs`` name replaced:
        the one place where keyword arguments become options.

        ``kwargs`` are field names, or torch FSDP's and FairScale's spellings (See [Note:
        Spellings from torch FSDP and FairScale] in ``_compat.py``):

            sharding_strategy: ``FULL_SHARD`` (reshard_after_forward=True), ``SHARD_GRAD_OP``
                (False); ``NO_SHARD`` runs as ``SHARD_GRAD_OP``: DDP's numbers with the state
                sharded at rest; ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2``: without resharding)
                shards within each shard group and replicates across them, as ``mesh=<2-D
                mesh>``: the groups come from ``device_mesh=`` (2-D), from
                ``process_group=(shard_group, replicate_group)``, or else from
                ``LOCAL_WORLD_SIZE`` (torchrun sets it: a node's ranks form a shard group).
                With ``FULL_SHARD`` or ``HYBRID_SHARD`` an int ``reshard_after_forward=k``
                keeps 1/k after forward.
            device_mesh: torch's name for ``mesh``.
            process_group: torch's name for ``group`` (a pair of groups for ``HYBRID_SHARD``).
            device_id: torch's name for ``device`` (an int: that accelerator).
            cpu_offload: torch's ``CPUOffload(offload_params=True)``; move_params_to_cpu:
                FairScale's ``True``; both mean ``offload="cpu"``.
            use_orig_params, flatten_parameters: accepted; memfit always keeps the original
                parameters and always communicates one flat buffer per unit.
            backward_prefetch, forward_prefetch, limit_all_gathers: accepted (validated);
                memfit's schedule is fixed: one unit prefetched ahead in forward and in backward
                (BACKWARD_PRE), at most one gather in flight beside the unit computing.
                ``backward_prefetch=BACKWARD_POST`` or ``None`` warns once: not available.
            ignored_modules, ignored_states: torch FSDP1's; every parameter of those modules
                (and the parameters ``ignored_states`` lists) joins ``ignored_params``.

        ``sync_module_states`` is True by default, unlike torch FSDP1's False.
        """
        native = {k: kwargs.pop(k) for k in FIELDS if k in kwargs}
        unknown = sorted(set(kwargs) - set(_SPELLINGS))
        if unknown:
            raise TypeError(
                f"memfit: unknown sharding option(s) {unknown}; the options are memfit.ShardOptions' fields "
                f"{list(FIELDS)} or torch FSDP's / FairScale's {list(_SPELLINGS)}"
            )
        if options is not None and not isinstance(options, ShardOptions):
            raise TypeError(f"memfit: options must be a memfit.ShardOptions, got {type(options).__name__}")
        if ignored := ignored_of(kwargs):
            native["ignored_params"] = frozenset(native.get("ignored_params") or ()) | ignored
        check_prefetch(
            kwargs.get("backward_prefetch", "BACKWARD_PRE"),
            kwargs.get("forward_prefetch", False),
            kwargs.get("limit_all_gathers", True),
        )
        _torch_spellings(native, kwargs)
        return dataclasses.replace(options or cls(), **native)


FIELDS = tuple(f.name for f in dataclasses.fields(ShardOptions))
KEYWORDS = frozenset(FIELDS + _SPELLINGS)  # every keyword argument that is a sharding option


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` split into the sharding options' and the rest (an integration's own)."""
    mine = {k: v for k, v in kwargs.items() if k in KEYWORDS}
    return mine, {k: v for k, v in kwargs.items() if k not in KEYWORDS}


def _torch_spellings(native: dict[str, Any], spelt: dict[str, Any]) -> None:
    """Put torch FSDP's and FairScale's spellings in ``spelt`` into ``native``, memfit's names."""
    where = "memfit.FullyShardedDataParallel"
    spelt = {k: v for k, v in spelt.items() if k not in _MOOT}
    group = native.get("group")
    if spelt.get("process_group") is not None:
        if group is not None and spelt["process_group"] is not group:
            raise ValueError(f"{where}: pass group= or process_group=, not both")
        group = spelt["process_group"]
    if spelt.get("device_id") is not None:
        target = device_of(spelt["device_id"])
        if native.get("device") is not None and torch.device(native["device"]) != target:
            raise ValueError(f"{where}: device={native['device']} and device_id={target} differ; pass one")
        native["device"] = target
    strategy, device_mesh = spelt.get("sharding_strategy"), spelt.get("device_mesh")
    hybrid = False
    if strategy is not None:
        native["reshard_after_forward"], hybrid = strategy_of(strategy, native.get("reshard_after_forward"))
    if device_mesh is not None and native.get("mesh") is not None:
        raise ValueError(f"{where}: pass mesh= or device_mesh=, not both")
    if device_mesh is not None or hybrid or isinstance(group, (tuple, list)):
        native["mesh"] = mesh_of(group, device_mesh, hybrid, strategy)  # one mesh for every unit
        group = None
    if group is not None:
        native["group"] = group
    if spelt.get("cpu_offload") is not None or spelt.get("move_params_to_cpu"):
        native["offload"] = offload_of(
            native.get("offload"), spelt.get("cpu_offload"), bool(spelt.get("move_params_to_cpu"))
        )


def _ignored(params: Any, where: str) -> frozenset[nn.Parameter]:
    """``ignored_params`` as a frozenset; refuses anything but a collection of parameters."""
    if params is None:
        return frozenset()
    if isinstance(params, torch.Tensor) or not isinstance(params, (set, frozenset, list, tuple)):
        raise TypeError(f"{where}: ignored_params must be a set of nn.Parameters, got {type(params).__name__}")
    odd = [type(p).__name__ for p in params if not isinstance(p, nn.Parameter)]
    if odd:
        raise TypeError(f"{where}: ignored_params must hold nn.Parameters only, got {odd[:3]}")
    return frozenset(params)
