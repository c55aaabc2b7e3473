"""Checkpointing whole modules in place: no wrapper, names unchanged, undoable."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from memfit._checkpoint._cache import cache_type
from memfit._checkpoint._function import _checkpoint
from memfit._checkpoint._offload import Offload, resolve_offload
from memfit._checkpoint._selective import resolve_save
from memfit._select import check, every_nth, resolve, select

# [Note: In-place module checkpointing]
# `checkpoint_module` sets an instance attribute `forward` on the module, a `_CheckpointedForward`
# that calls the class's forward through `memfit.checkpoint`. `nn.Module.__call__` still runs
# the module's own hooks around it, once per step (they are not part of the recompute), and
# parameter names, `state_dict()` keys and `named_modules()` stay exactly as they were, so
# optimizer param groups built before or after keep working. Deleting the attribute restores
# the module (`remove_checkpointing`).

__all__ = [
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpoint_wrapper",
    "every_nth",
    "remove_checkpointing",
]


class _CheckpointedForward:
    """The instance-level `forward` of a checkpointed module."""

    def __init__(self, module: nn.Module, offload: Offload | None, save, name: str) -> None:
        self.inner = module.__dict__.get("forward")  # a forward set on the instance before us
        self.module = module
        self.offload = offload
        self.save = save
        self.name = name

    def _plain_forward(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.module.training and getattr(type(self.module), "_can_checkpoint_with_cache", True) is False:
            args, kwargs = _without_cache(args, kwargs)
        return _checkpoint(
            self._plain_forward, args, kwargs, offload=self.offload, save=self.save, name=self.name, module=self.module
        )


def _without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """No cache for a layer that declares it cannot be checkpointed with one (use_cache=False,
    None for any transformers Cache argument: GPT-2 passes it by position); see [Note: Key/value
    caches under recompute]."""
    cache = cache_type()
    if cache is None:
        return args, kwargs
    args = tuple(None if isinstance(a, cache) else a for a in args)
    kwargs = {k: None if isinstance(v, cache) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def checkpoint_module(
    module: nn.Module,
    *,
    offload: str | Offload | None = None,
    save: str | Callable | None = None,
    name: str | None = None,
) -> nn.Module:
    """Checkpoint ``module`` in place: its forward keeps only its inputs; backward recomputes.

    Parameter names, ``state_dict()`` keys and ``named_modules()`` are unchanged (no wrapper
    and no prefix). Calling it again with the same options does nothing; with other options
    it raises ValueError: call :func:`remove_checkpointing` first. Returns ``module``.

    Args:
        offload: where the kept tensors wait for backward: None, ``"cpu"``, ``"disk"`` or a
            :class:`memfit.Offload` (parameters and views of them are never offloaded).
        save: which op outputs to keep instead of recomputing (None: full recompute,
            ``"linear"``, ``"matmul"``, ``"all"`` or a callable(aten op) -> bool), as in
            :func:`memfit.checkpoint`.
        name: how errors name the module (default: its class; apply_activation_checkpointing
            passes the module's path in the model).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"memfit.checkpoint_module: expected an nn.Module, got {type(module).__name__}")
    offload, save = resolve_offload(offload), resolve_save(save)
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        if (current.offload, current.save) == (offload, save):
            return module
        raise ValueError(
            f"memfit.checkpoint_module: {current.name} is already checkpointed with "
            f"offload={current.offload!r}, save={current.save!r}; call memfit.remove_checkpointing(module) "
            f"before checkpointing it again with offload={offload!r}, save={save!r}."
        )
    module.forward = _CheckpointedForward(module, offload, save, name or type(module).__name__)
    return module


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """FairScale's spelling of :func:`checkpoint_module`: same module back, names unchanged."""
    return checkpoint_module(module, offload="cpu" if offload_to_cpu else None)


def remove_checkpointing(module: nn.Module) -> int:
    """Undo checkpointing on ``module`` and all its submodules; returns how many were undone."""
    undone = 0
    for m in module.modules():
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, _CheckpointedForward):
            if fwd.inner is None:
                del m.forward
            else:
                m.forward = fwd.inner
            undone += 1
    return undone


def _selector(policy) -> Callable[[nn.Module], list[tuple[str, nn.Module]]]:
    """The modules ``policy`` selects (see [Note: One module-selection policy])."""
    check(policy, "memfit.apply_activation_checkpointing", "policy")
    return lambda model: select(policy, model, "memfit.apply_activation_checkpointing", "policy")


def apply_activation_checkpointing(
    model: nn.Module,
    policy=None,
    *,
    offload: str | Offload | None = None,
    save: str | Callable | None = None,
    check_fn: Callable[[nn.Module], bool] | None = None,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] | None = None,
    auto_wrap_policy=None,
) -> list[str]:
    """Checkpoint, in place, the submodules of ``model`` that ``policy`` selects.

    ``policy``: a module class, a tuple (or set, list) of classes, ``every_nth(n, classes)``, a
    ``callable(module) -> bool`` or an int (modules with at least that many parameters): the
    same policy as sharding's ``auto_wrap_policy``; or, in torch's spelling, ``check_fn=callable(module) ->
    bool`` or ``auto_wrap_policy=`` (torch's wrap policies). When a selected module contains
    other selected modules only the outermost is checkpointed (a nested checkpoint would
    recompute the same work twice). ``offload`` and ``save`` are passed to
    :func:`checkpoint_module`. Returns the paths of the modules checkpointed (``""`` is the
    model itself).

    ``checkpoint_wrapper_fn`` (torch's argument; default: memfit's in-place checkpointing):
    torch's ``checkpoint_wrapper`` / ``offload_wrapper`` (or a ``functools.partial`` of
    them) and memfit's :func:`checkpoint_wrapper` checkpoint in place, names unchanged
    (``offload_wrapper``: ``offload="cpu"``; torch's ``checkpoint_impl`` is moot: memfit's
    checkpoint is non-reentrant); any other ``fn(module) -> module`` is called on each selected
    module, and a module it returns in its place replaces it in its parent, as torch does.
    """
    if policy is None and check_fn is None and auto_wrap_policy is not None:
        policy = resolve(auto_wrap_policy, model)  # torch's policy objects and callables
    elif auto_wrap_policy is not None:
        raise TypeError("memfit.apply_activation_checkpointing: pass auto_wrap_policy= alone, without policy/check_fn")
    if (policy is None) == (check_fn is None):
        raise TypeError("memfit.apply_activation_checkpointing: pass a policy or check_fn= (exactly one)")
    select = _selector(policy if check_fn is None else check_fn)
    wrap = _wrapper(checkpoint_wrapper_fn, offload, save)
    chosen: list[str] = []
    for path, module in select(model):
        if any(path == c or path.startswith(c + ".") or c == "" for c in chosen):
            continue
        wrap(model, path, module, f"{path or '<root>'} ({type(module).__name__})")
        chosen.append(path)
    return chosen


def _wrapper(fn, offload, save) -> Callable[[nn.Module, str, nn.Module, str], None]:
    """How apply_activation_checkpointing checkpoints one selected module (See its docstring)."""
    inner, kwargs = (fn.func, dict(fn.keywords)) if isinstance(fn, functools.partial) else (fn, {})
    torch_fns = _torch_wrappers()
    if fn is None or inner is checkpoint_wrapper or inner in torch_fns.values():
        if (inner is checkpoint_wrapper and kwargs.get("offload_to_cpu")) or inner is torch_fns.get("offload"):
            offload = offload or "cpu"
        off, sv = resolve_offload(offload), resolve_save(save)

        def in_place(model: nn.Module, path: str, module: nn.Module, label: str) -> None:
            checkpoint_module(module, offload=off, save=sv, name=label)

        return in_place
    if offload is not None or save is not None:
        raise TypeError(
            "memfit.apply_activation_checkpointing: offload= and save= apply to memfit's checkpointing; a custom "
            f"checkpoint_wrapper_fn ({fn!r}) does its own: pass one or the other"
        )

    def replace(model: nn.Module, path: str, module: nn.Module, label: str) -> None:
        new = fn(module)
        if new is not module and isinstance(new, nn.Module):
            if not path:
                raise ValueError(f"memfit.apply_activation_checkpointing: {label} is the model; it cannot be replaced")
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, new)

    return replace


def _torch_wrappers() -> dict:
    """torch's checkpoint_wrapper and offload_wrapper, when torch has them."""
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ckpt
    except ImportError:  # torch built without distributed
        return {}
    return {"checkpoint": ckpt.checkpoint_wrapper, "offload": ckpt.offload_wrapper}
