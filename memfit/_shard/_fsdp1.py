"""torch FSDP1's checkpoint and utility API on ``memfit.FullyShardedDataParallel``:
``state_dict_type`` / ``set_state_dict_type``, ``optim_state_dict`` / ``optim_state_dict_to_load``,
``summon_full_params`` spelled on the class, and ``model.clip_grad_norm_``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from memfit._shard import _utils
from memfit._shard._optim_state import from_dtensors_or_full, install_optimizer_state_hooks
from memfit._shard._unit import ShardedModule

__all__ = ["FSDP1API"]

# [Note: FSDP1's state_dict types on memfit]
# memfit's `model.state_dict()` holds DTensors (FSDP1's SHARDED_STATE_DICT, as with a device
# mesh); that stays its default. `FSDP.state_dict_type(model, FULL_STATE_DICT, FullStateDictConfig(
# offload_to_cpu, rank0_only))` (or `set_state_dict_type`) adds a state_dict post-hook to `model`
# that gathers each DTensor to its full tensor one at a time (every rank calls it: collectives),
# moves it to the host at once with `offload_to_cpu`, and with `rank0_only` leaves the other
# ranks an empty dict, as FSDP1 does. `load_state_dict` takes full tensors or DTensors whatever
# the type. The optimizer follows the same setting: `FSDP.optim_state_dict(model, optim)` is
# keyed by parameter names (torch's get_optimizer_state_dict), full tensors under
# FULL_STATE_DICT (FSDP1's default when no type was set; `FullOptimStateDictConfig(rank0_only,
# offload_to_cpu)`), DTensors under SHARDED_STATE_DICT. LOCAL_STATE_DICT (FSDP1's flat
# parameters) has no memfit equivalent and is refused.

_SETTINGS = "_memfit_fsdp1_settings"  # (StateDictSettings, hook handle or None) on the model


def _settings(module: nn.Module) -> StateDictSettings | None:
    entry = module.__dict__.get(_SETTINGS)
    return entry[0] if entry else None


def _full_hook(config: FullStateDictConfig):
    def gather(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        for key, value in list(state_dict.items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            state_dict[key] = full.cpu() if config.offload_to_cpu and isinstance(full, torch.Tensor) else full
        if config.rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            state_dict.clear()

    return gather


def _apply(module: nn.Module, settings: StateDictSettings | None) -> None:
    old = module.__dict__.pop(_SETTINGS, None)
    if old and old[1] is not None:
        old[1].remove()
    if settings is None:
        return
    handle = None
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
        handle = module.register_state_dict_post_hook(_full_hook(cast(FullStateDictConfig, settings.state_dict_config)))
    module.__dict__[_SETTINGS] = (settings, handle)


def _checked(
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None,
    optim_state_dict_config: OptimStateDictConfig | None,
) -> StateDictSettings:
    kinds: tuple[type[StateDictConfig], type[OptimStateDictConfig]]
    if state_dict_type == StateDictType.FULL_STATE_DICT:
        kinds = (FullStateDictConfig, FullOptimStateDictConfig)
    elif state_dict_type == StateDictType.SHARDED_STATE_DICT:
        kinds = (ShardedStateDictConfig, ShardedOptimStateDictConfig)
    else:
        raise NotImplementedError(
            f"memfit.FullyShardedDataParallel: {state_dict_type} (FSDP1's flat parameters) has no memfit "
            "equivalent; use SHARDED_STATE_DICT (DTensors, for torch.distributed.checkpoint) or FULL_STATE_DICT"
        )
    config = state_dict_config if state_dict_config is not None else kinds[0]()
    optim_config = optim_state_dict_config if optim_state_dict_config is not None else kinds[1]()
    for given, kind in ((config, kinds[0]), (optim_config, kinds[1])):
        if not isinstance(given, kind):
            raise ValueError(
                f"memfit.FullyShardedDataParallel: {state_dict_type.name} takes a {kind.__name__}, got "
                f"{type(given).__name__}"
            )
    return StateDictSettings(state_dict_type, config, optim_config)


def _optim_options(model: nn.Module) -> tuple[StateDictOptions, bool, bool]:
    """torch's options for the model's current setting; whether only rank 0 keeps the result;
    whether it goes to the host (torch's cpu_offload with full_state_dict also means rank 0
    only, FSDP1's offload_to_cpu does not: moved here instead)."""
    settings = _settings(model)
    if settings is not None and settings.state_dict_type == StateDictType.SHARDED_STATE_DICT:
        return StateDictOptions(cpu_offload=settings.optim_state_dict_config.offload_to_cpu), False, False
    config = settings.optim_state_dict_config if settings is not None else FullOptimStateDictConfig()
    rank0_only = bool(getattr(config, "rank0_only", False))
    return StateDictOptions(full_state_dict=True), rank0_only, config.offload_to_cpu


class FSDP1API(ShardedModule):
    """Mixed into ``memfit.FullyShardedDataParallel``: FSDP1's class and instance methods (a
    ShardedModule, so that ``user_class`` skips it)."""

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set what ``module.state_dict()`` and :meth:`optim_state_dict` return (FSDP1's
        semantics, See [Note: FSDP1's state_dict types on memfit]); returns the previous setting."""
        previous = FSDP1API.get_state_dict_type(module)
        _apply(module, _checked(state_dict_type, state_dict_config, optim_state_dict_config))
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The current setting (memfit's default: SHARDED_STATE_DICT, DTensors)."""
        settings = _settings(module)
        if settings is None:
            return StateDictSettings(
                StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
            )
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """Within the context, ``module.state_dict()`` and :meth:`optim_state_dict` follow
        ``state_dict_type`` and its configs (FSDP1's ``FSDP.state_dict_type``)."""
        previous = _settings(module)
        _apply(module, _checked(state_dict_type, state_dict_config, optim_state_dict_config))
        try:
            yield
        finally:
            _apply(module, previous)

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by parameter names: full tensors (FULL_STATE_DICT, the default
        when no type was set; with ``rank0_only`` other ranks get {}) or DTensors
        (SHARDED_STATE_DICT). Every rank must call it."""
        if optim_state_dict is not None:
            raise NotImplementedError(
                "memfit.FullyShardedDataParallel.optim_state_dict: pass the optimizer; its state is read from it "
                "(optim_state_dict= is not needed)"
            )
        del group  # the units' own groups
        options, rank0_only, to_host = _optim_options(model)
        osd = get_optimizer_state_dict(model, optim, options=options)
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return tree_map_only(torch.Tensor, lambda t: t.cpu(), osd) if to_host else osd

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from a state dict of :meth:`optim_state_dict`
        (full or DTensors, at any world size). With ``rank0_only`` under FULL_STATE_DICT the
        other ranks may pass {}: rank 0's is broadcast. ``load_directly``: loaded already."""
        del is_named_optimizer, group
        options, rank0_only, _ = _optim_options(model)
        if options.full_state_dict:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=rank0_only)
        install_optimizer_state_hooks(optim)  # its load_state_dict takes what we return
        set_optimizer_state_dict(model, optim, optim_state_dict, options=options)
        return optim.state_dict()  # DTensors views of what was loaded: loading them again is exact

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """FSDP1's older API: the full optimizer state keyed by parameter names, as torch FSDP1's
        (``param_groups`` list the names too); with ``rank0_only`` the other ranks get {}. Every
        rank must call it."""
        del group
        if optim_input is not None:
            raise NotImplementedError(
                "memfit.FullyShardedDataParallel.full_optim_state_dict: optim_input is not supported; the "
                "parameters are read from the optimizer"
            )
        osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return cast("dict[str, Any]", osd)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """FSDP1's older API: rank 0's :meth:`full_optim_state_dict` (the others pass None) made
        this rank's state dict for ``optim.load_state_dict`` (its rows of every state tensor).
        The whole state is broadcast as one object: every rank holds it briefly, in host memory."""
        del model, group
        if optim is None or optim_input is not None:
            raise NotImplementedError(
                "memfit.FullyShardedDataParallel.scatter_full_optim_state_dict: pass optim= (the optimizer "
                "the state is for); optim_input is not supported"
            )
        box = [full_optim_state_dict if not dist.is_initialized() or dist.get_rank() == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [tree_map_only(torch.Tensor, lambda t: t.cpu(), box[0])]
            dist.broadcast_object_list(box, src=0)
        install_optimizer_state_hooks(optim)
        return from_dtensors_or_full(optim, cast("dict[str, Any]", box[0]))  # rank 0's, broadcast

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """FSDP1's spelling of :func:`memfit.summon_full_params`, with its flags: ``rank0_only``
        (the other ranks keep their shards inside; with ``writeback=True`` refused, as in
        FSDP1) and ``offload_to_cpu`` (host copies, gathered a unit at a time; written back
        from them with ``writeback``). ``recurse=False`` gathers the units below too (memfit
        summons the whole model); ``with_grads=True`` is refused."""
        del recurse
        if with_grads:
            raise NotImplementedError(
                "memfit.FullyShardedDataParallel.summon_full_params: with_grads=True is not supported; "
                "read the sharded gradients from model.parameters() (each rank's rows)"
            )
        with _utils.summon_full_params(module, writeback, rank0_only, offload_to_cpu):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm; returns that norm
        (before clipping) as a tensor on the gradients' device, in their dtype, as FSDP1's
        ``clip_grad_norm_`` does."""
        return _utils.clip_grad_norm_tensor(cast(nn.Module, self), max_norm, norm_type)
