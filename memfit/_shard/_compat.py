"""torch FSDP's and FairScale's spellings of FullyShardedDataParallel's arguments, in memfit's terms."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from memfit._shard._layout import hybrid_from_groups, hybrid_mesh
from memfit._shard._mixed import MixedPrecision

# [Note: Spellings from torch FSDP and FairScale]
# `FullyShardedDataParallel(module, ...)` is meant to replace `torch.distributed.fsdp.
# FullyShardedDataParallel(module, ...)` or FairScale's in a training script with only the
# import changed. Each spelling maps onto memfit's own arguments here:
#   auto_wrap_policy (memfit/_select.py's resolve): torch's policy objects (ModuleWrapPolicy,
#     CustomPolicy, any _Policy) are run once on the model for the set of modules they wrap; the old-style callables and
#     their partials (transformer_auto_wrap_policy, size_based_auto_wrap_policy,
#     lambda_auto_wrap_policy, `fn(module, recurse, nonwrapped_numel)`) are walked top-down
#     as torch's own recursive wrap walks them.
#   sharding_strategy: FULL_SHARD -> reshard_after_forward=True; SHARD_GRAD_OP ->
#     reshard_after_forward=False; NO_SHARD -> reshard_after_forward=False too: the same
#     numbers as DDP (gradients averaged over the ranks) with the state sharded at rest, since
#     memfit has no replicated mode (use DistributedDataParallel for that); HYBRID_SHARD ->
#     shard(mesh=<2-D mesh>) (_HYBRID_SHARD_ZERO2: reshard_after_forward=False), the mesh from
#     device_mesh=, process_group=(shard_group, replicate_group), or LOCAL_WORLD_SIZE.
#   mixed_precision: torch's MixedPrecision and FSDP2's MixedPrecisionPolicy become memfit's
#     (param_dtype None: fp32); FairScale's `mixed_precision=True` is fp16 compute. Where FSDP1's
#     differs: buffer_dtype=None casts buffers to param_dtype (FSDP1 leaves them), every norm
#     layer keeps fp32 (FSDP1: BatchNorm, its _module_classes_to_ignore), every unit's floating
#     inputs are cast (cast_forward_inputs=True); keep_low_precision_grads=True is not
#     available (the gradients reach the fp32 shards in fp32): a warning, once, says so.
#   process_group (torch) is group; cpu_offload=CPUOffload(offload_params=True) (torch) or
#     move_params_to_cpu=True (FairScale) is offload="cpu"; device_id is where the module is
#     moved (or, on the meta device, its chunks allocated).
#   use_orig_params (torch) and flatten_parameters (FairScale) are accepted and change nothing:
#     memfit always keeps the original parameters (their names, param groups, freezing) and
#     always communicates one flat buffer per unit.
#   backward_prefetch, forward_prefetch, limit_all_gathers (torch) are accepted and change
#     nothing: memfit's schedule is fixed (See [Note: One sharded training step]): it gathers
#     the next unit in forward order before the current one computes (forward_prefetch=True)
#     and, in backward, at the first gradient of a unit's outputs, the unit before it
#     (BACKWARD_PRE), so at most one gather is in flight beside the unit computing (the bound
#     limit_all_gathers=True sets). backward_prefetch=BACKWARD_POST or None asks for less
#     overlap to save memory, which memfit cannot do: a warning, once per process, says so.
#   param_init_fn (torch) is ShardOptions.param_init_fn: parameters built on the meta device
#     get their values from it through memfit.materialize(model, init=param_init_fn) once
#     sharded (See [Note: What materialize initialises]).
#   sync_module_states defaults to True, unlike torch FSDP1's False: ranks that built the
#     model from different seeds start equal (a broadcast per parameter at sharding time).
#   ignored_modules, ignored_states (torch) are refused for now, naming the argument.

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_WARNED: set[str] = set()  # the warnings given in this process (once each)
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False, "HYBRID_SHARD": True, _HYBRID[1]: False}


def strategy_of(sharding_strategy, reshard_after_forward: bool | int | None) -> tuple[bool | int, bool]:
    """(reshard_after_forward, hybrid) for torch's ``sharding_strategy`` (an enum member or its name)."""
    if sharding_strategy is None:
        return (True if reshard_after_forward is None else reshard_after_forward), False
    name = sharding_strategy if isinstance(sharding_strategy, str) else getattr(sharding_strategy, "name", None)
    wanted = _RESHARD.get(name) if name is not None else None  # See [Note: Spellings from torch FSDP and FairScale]
    if wanted is None:
        raise ValueError(
            f"memfit.FullyShardedDataParallel: unknown sharding_strategy {sharding_strategy!r}; expected FULL_SHARD, "
            "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (torch.distributed.fsdp.ShardingStrategy "
            "or its name)"
        )
    # keeping 1/k after forward (k > 1) is a kind of resharding; k = 1 keeps everything (SHARD_GRAD_OP)
    partial = type(reshard_after_forward) is int and reshard_after_forward > 1 and wanted is True
    same = type(reshard_after_forward) is bool and reshard_after_forward == wanted  # 1 is not True here
    if reshard_after_forward is not None and not same and not partial:
        raise ValueError(
            f"memfit.FullyShardedDataParallel: sharding_strategy={name} means reshard_after_forward={wanted}, "
            f"but reshard_after_forward={reshard_after_forward} was passed too; pass one of them."
        )
    return (cast(int, reshard_after_forward) if partial else wanted), name in _HYBRID


def mesh_of(group, device_mesh, hybrid: bool, strategy=None):
    """The device mesh torch FSDP's hybrid spellings stand for (None: shard over ``group``);
    ``strategy``: the sharding_strategy passed, if any."""
    where = "memfit.FullyShardedDataParallel"
    if device_mesh is not None:
        if group is not None:
            raise ValueError(f"{where}: pass process_group= or device_mesh=, not both")
        if hybrid and device_mesh.ndim != 2:
            raise ValueError(f"{where}: HYBRID_SHARD needs a 2-D (replicate, shard) device_mesh, got {device_mesh}")
        if strategy is not None and not hybrid and device_mesh.ndim == 2:  # torch FSDP refuses it too
            name = getattr(strategy, "name", strategy)
            raise ValueError(
                f"{where}: sharding_strategy={name} shards over every rank of a 1-D device_mesh, but a 2-D mesh "
                f"was passed ({device_mesh}); for hybrid sharding pass sharding_strategy=HYBRID_SHARD (or none)"
            )
        return device_mesh
    if not hybrid:
        if isinstance(group, (tuple, list)):
            raise ValueError(f"{where}: a pair of process groups needs sharding_strategy=HYBRID_SHARD")
        return None
    if isinstance(group, (tuple, list)) and len(group) == 2:
        return hybrid_from_groups(group[0], group[1], where).mesh
    if group is not None:
        raise ValueError(
            f"{where}: HYBRID_SHARD takes process_group=(shard_group, replicate_group) or device_mesh=, "
            f"not one group ({group!r})"
        )
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        raise ValueError(
            f"{where}: HYBRID_SHARD without process_group= or device_mesh= shards within a node, and "
            "LOCAL_WORLD_SIZE (set by torchrun) is not set; pass device_mesh=init_device_mesh(..., (nodes, per_node))"
        )
    return hybrid_mesh(int(local), where)


def mixed_precision_of(spec, where: str = "memfit.FullyShardedDataParallel") -> MixedPrecision | None:
    """memfit's MixedPrecision for memfit's, torch FSDP's (1 and 2) or FairScale's (a bool) spelling."""
    if spec is None or spec is False or isinstance(spec, MixedPrecision):
        return spec or None
    if spec is True:  # FairScale: compute in fp16, fp32 master shards
        return MixedPrecision(param_dtype=torch.float16)
    fields = ("param_dtype", "reduce_dtype")
    if all(hasattr(spec, f) for f in fields):  # torch.distributed.fsdp.MixedPrecision / MixedPrecisionPolicy
        if getattr(spec, "keep_low_precision_grads", False) and "keep_low_precision_grads" not in _WARNED:
            _WARNED.add("keep_low_precision_grads")
            warnings.warn(
                f"{where}: MixedPrecision(keep_low_precision_grads=True) is not available; the gradients reach "
                "the fp32 shards in fp32 (See [Note: Mixed precision])",
                stacklevel=5,
            )
        if spec.param_dtype is None and spec.reduce_dtype is None and getattr(spec, "buffer_dtype", None) is None:
            return None
        return MixedPrecision(
            param_dtype=spec.param_dtype or torch.float32,
            reduce_dtype=spec.reduce_dtype,
            buffer_dtype=getattr(spec, "buffer_dtype", None),
        )
    raise TypeError(
        f"{where}: mixed_precision must be a memfit.MixedPrecision, "
        f"a torch.distributed.fsdp.MixedPrecision / MixedPrecisionPolicy, True (fp16) or None; got {spec!r}"
    )


def offload_of(offload: str | None, cpu_offload, move_params_to_cpu: bool) -> str | None:
    """``offload`` for memfit's, torch's (``CPUOffload``) and FairScale's (a bool) spellings."""
    if cpu_offload is not None and not isinstance(cpu_offload, bool):
        cpu_offload = getattr(cpu_offload, "offload_params", True)  # CPUOffload / CPUOffloadPolicy
    if cpu_offload or move_params_to_cpu:
        if offload not in (None, "cpu"):
            raise ValueError(f"memfit.FullyShardedDataParallel: cpu offload asked for, but offload={offload!r}")
        return "cpu"
    return offload


def check_prefetch(backward_prefetch, forward_prefetch, limit_all_gathers) -> None:
    """Validate torch FSDP1's prefetch and rate-limit arguments, which memfit's fixed schedule
    makes moot; warn once when the value asks for less prefetching than memfit does (See
    [Note: Spellings from torch FSDP and FairScale])."""
    where = "memfit.FullyShardedDataParallel"
    for name, value in (("forward_prefetch", forward_prefetch), ("limit_all_gathers", limit_all_gathers)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
    asked: str | None = "None"
    if backward_prefetch is not None:
        asked = backward_prefetch if isinstance(backward_prefetch, str) else getattr(backward_prefetch, "name", None)
        if asked not in ("BACKWARD_PRE", "BACKWARD_POST"):
            raise ValueError(
                f"{where}: unknown backward_prefetch {backward_prefetch!r}; expected BACKWARD_PRE, BACKWARD_POST "
                "or None (torch.distributed.fsdp.BackwardPrefetch or its name)"
            )
    if asked is not None and asked != "BACKWARD_PRE" and asked not in _WARNED:
        _WARNED.add(asked)
        warnings.warn(
            f"{where}: backward_prefetch={asked} is not available; memfit prefetches as BACKWARD_PRE (the "
            "previous unit's all-gather starts when a unit's backward begins: one unit of full parameters "
            "more in memory than without prefetching). Pass BACKWARD_PRE, or leave it out, to silence this.",
            stacklevel=4,
        )


def ignored_of(kwargs: dict) -> frozenset[nn.Parameter]:
    """torch FSDP1's ``ignored_modules`` / ``ignored_states`` as memfit's ``ignored_params``:
    every parameter of the ignored modules (and their submodules), and the parameters given."""
    out: set[nn.Parameter] = set()
    for name in ("ignored_modules", "ignored_states"):
        value = kwargs.get(name)
        if value is None:
            continue
        if isinstance(value, (nn.Module, nn.Parameter)) or not isinstance(value, Iterable):
            raise TypeError(
                f"memfit.FullyShardedDataParallel: {name}= takes a list or set of modules"
                f"{' or parameters' if name == 'ignored_states' else ''}, got {type(value).__name__}"
            )
        for item in value:
            if isinstance(item, nn.Parameter) and name == "ignored_states":
                out.add(item)
            elif isinstance(item, nn.Module):
                out.update(item.parameters())
            else:
                raise TypeError(
                    f"memfit.FullyShardedDataParallel: {name}= holds a {type(item).__name__}; it takes modules"
                    f"{' and parameters' if name == 'ignored_states' else ''}"
                )
    return frozenset(out)


def device_of(device_id) -> torch.device:
    """torch FSDP's ``device_id``: an int is an index on the current accelerator."""
    if isinstance(device_id, int):
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if acc is None:
            raise ValueError(
                f"memfit.FullyShardedDataParallel: device_id={device_id} names an accelerator, and this machine "
                "has none; pass device_id=torch.device('cpu') or leave it out."
            )
        return torch.device(acc.type, device_id)
    return torch.device(device_id)
