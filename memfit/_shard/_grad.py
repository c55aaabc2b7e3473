"""Sharded gradients that torch's norm functions read as shards of one tensor, as FSDP2's DTensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PartialNorm", "ShardGrad", "as_shard_grad"]

# [Note: Sharded gradients and torch's clip_grad_norm_]
# Under torch FSDP2 a gradient is a DTensor, so a script's
# torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) clips by the global norm: each
# gradient's norm is a partial value (this rank's shard's norm), the stack of them stays
# partial, and the norm of the stack reduces it over the ranks first, elementwise: x ** p
# summed, then ** (1 / p) (the max for the inf-norm; DTensor's _NormPartial), one all_reduce of
# every parameter's norm, then the norm of those on every rank (measured: the stack's norm is
# Replicate, not a partial of partials).
# memfit's chunks are plain tensors, so after the import swap the same call would clip every
# rank by the norm of its own rows, silently. So where a unit's shard group has more than one
# rank, a chunk's .grad is a ShardGrad: a torch.Tensor subclass (the same storage as the
# reduce-scatter's output) whose __torch_function__ runs every op as on a plain tensor, with
# plain results (the optimizer's foreach ops and memfit's own code see no difference), except a
# whole-tensor norm (torch.linalg.vector_norm, torch.norm, Tensor.norm, torch._foreach_norm):
# that returns a PartialNorm, this rank's value of a norm over the shard group. A PartialNorm
# moved (.to) or stacked with others of the same order and group stays partial; any other use
# (its norm included) reduces it first, once (one all_reduce on the compute
# device; the value is kept, so a later .item() on one rank needs no collective). That is
# torch's op sequence on FSDP2's DTensors, so torch's clip_grad_norm_ returns FSDP2's norm and
# clips by it, bit for bit on the same shards (tests/distributed/test_fully_shard.py). Under
# hybrid sharding the replicas hold the same shards: the norm is reduced over the shard group.
# A norm over some dims (dim=...) stays this rank's rows' norm, as any op on the rows: the
# DTensor semantics stop at whole-tensor norms. The gradients torch's clip reads go through its
# per-tensor path (foreach is for plain tensors), one small op per gradient; memfit.clip_grad_norm_
# stays the one-collective, few-kernel way to clip. torch._foreach_norm over a list mixing
# ShardGrads and plain tensors gives a PartialNorm for each ShardGrad and the plain norm for
# the others (a replicated tensor's, the same on every rank), so a norm of their stack is the
# global one. An empty shard (a rank holding no rows) answers every norm with the reduction's
# identity (0; +inf for the -inf norm) instead of torch's error for the inf-norm of an empty
# tensor, so that every rank takes the same path into the same collective. torch.save and
# pickle write a ShardGrad as a plain tensor of this rank's rows (a process group cannot be
# pickled); copy.deepcopy gives a ShardGrad of the same group. Untested here: NCCL (the reduction moves to
# the compute device, so offloaded host gradients work there too).

_METADATA = frozenset(
    {
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.stride,
    }
)
# the whole-tensor norms a ShardGrad answers with a PartialNorm: their order's name and default
_NORMS: dict[Callable, tuple[str, Any]] = {
    torch.linalg.vector_norm: ("ord", 2.0),
    torch.norm: ("p", "fro"),
    torch.Tensor.norm: ("p", "fro"),
}


class _Spec:
    """What a partial norm is reduced over and how: the norm's order, the shard group, the
    device the collective runs on."""

    def __init__(self, order: float, group: dist.ProcessGroup, device: torch.device) -> None:
        self.order, self.group, self.device = order, group, device

    def same(self, other: _Spec) -> bool:
        return self.order == other.order and self.group is other.group


class ShardGrad(torch.Tensor):
    """This rank's rows of a sharded parameter's gradient (See [Note: Sharded gradients and
    torch's clip_grad_norm_])."""

    _memfit_spec: tuple[dist.ProcessGroup, torch.device]

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        order = _norm_order(func, args, kwargs)
        if order is not None and isinstance(args[0], ShardGrad):
            group, device = args[0]._memfit_spec
            if args[0].numel() == 0:  # an empty shard: every rank joins the same reduction
                return _partial(_identity(order, args[0], kwargs.get("dtype")), _Spec(order, group, device))
            with torch._C.DisableTorchFunctionSubclass():
                local = func(*args, **kwargs)
            return _partial(local, _Spec(order, group, device))
        if func is torch._foreach_norm and any(isinstance(t, ShardGrad) for t in args[0]):
            return _foreach_norms(list(args[0]), args[1:], kwargs)
        return _plain_call(func, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save / pickle: a copy of this rank's rows as a plain tensor (a process group
        # cannot be pickled; FSDP2's DTensor keeps its mesh, which can), not the reduce output it views
        return self.as_subclass(torch.Tensor).clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> ShardGrad:
        # a copy of the rows, still a ShardGrad of the same shard group (as a DTensor's copy)
        copied = self.as_subclass(torch.Tensor).clone().as_subclass(ShardGrad)
        copied._memfit_spec = self._memfit_spec
        memo[id(self)] = copied
        return copied


def _identity(order: float, like: torch.Tensor, dtype: Any = None) -> torch.Tensor:
    """The norm of an empty shard, as the reduction over the ranks needs it: 0 (+inf for the
    -inf norm); torch refuses the inf-norm of an empty tensor, which on one rank only would
    leave the others waiting in the reduction."""
    value = math.inf if order == -math.inf else 0.0
    real = like.real.dtype if like.is_complex() else like.dtype
    return torch.full((), value, dtype=dtype or real, device=like.device)


def _foreach_norms(tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """torch._foreach_norm over a list holding ShardGrads: a PartialNorm for each of those
    (empty shards included), this rank's plain norm for the plain tensors (the same on every
    rank, as a Replicate DTensor's), one kernel over the tensors that are not empty shards."""
    order = float(args[0] if args else kwargs.get("ord", 2.0))
    empty = [isinstance(t, ShardGrad) and t.numel() == 0 for t in tensors]
    with torch._C.DisableTorchFunctionSubclass():
        norms = iter(torch._foreach_norm([t for t, e in zip(tensors, empty) if not e], *args, **kwargs))
    out: list[torch.Tensor] = []
    for t, e in zip(tensors, empty):
        n = _identity(order, t, kwargs.get("dtype")) if e else next(norms)
        out.append(_partial(n, _Spec(order, *t._memfit_spec)) if isinstance(t, ShardGrad) else n)
    return out


class PartialNorm(torch.Tensor):
    """This rank's value of a norm over the shard group, reduced on first use (See [Note:
    Sharded gradients and torch's clip_grad_norm_])."""

    _memfit_spec: _Spec
    _memfit_reduced: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is torch.Tensor.to and isinstance(first, PartialNorm) and first._memfit_reduced is None:
            with torch._C.DisableTorchFunctionSubclass():
                return _partial(func(*args, **kwargs), first._memfit_spec)
        if func is torch.stack and isinstance(first, list | tuple) and _all_partial(first):
            with torch._C.DisableTorchFunctionSubclass():
                return _partial(func(*args, **kwargs), first[0]._memfit_spec)
        return _plain_call(func, args, kwargs)


def as_shard_grad(grad: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """``grad`` (a view of the reduce-scatter's output) as a ShardGrad of shard group ``group``,
    reduced on ``device``: plain where the group is one rank (the rows are the whole tensor)."""
    if dist.get_world_size(group) == 1:
        return grad
    shard = grad.as_subclass(ShardGrad)
    shard._memfit_spec = (group, device)
    return shard


def _partial(local: torch.Tensor, spec: _Spec) -> PartialNorm:
    out = local.as_subclass(PartialNorm)
    out._memfit_spec, out._memfit_reduced = spec, None
    return out


def _all_partial(items: Any) -> bool:
    parts = [t for t in items if isinstance(t, PartialNorm)]
    if len(parts) != len(items) or any(t._memfit_reduced is not None for t in parts):
        return False
    return all(t._memfit_spec.same(parts[0]._memfit_spec) for t in parts)


def _norm_order(func: Callable, args: tuple, kwargs: dict) -> float | None:
    """The order of a whole-tensor norm call (None: not one): torch.linalg.vector_norm(x, ord),
    torch.norm / Tensor.norm(x, p) over every element, into no ``out``."""
    if func not in _NORMS:
        return None
    name, default = _NORMS[func]
    order: Any = args[1] if len(args) > 1 else kwargs.get(name, default)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    order = 2 if order in ("fro", None) else order
    if dim is not None or kwargs.get("out") is not None or isinstance(order, str):
        return None
    return float(order)


def _reduced(t: PartialNorm) -> torch.Tensor:
    """The norm over the shard group, elementwise, once: x ** p summed over the ranks, then
    ** (1 / p); the max (min) for the inf (-inf) norm, the sum of counts for the 0-norm."""
    if t._memfit_reduced is None:
        spec = t._memfit_spec
        with torch._C.DisableTorchFunctionSubclass():
            local = t.as_subclass(torch.Tensor)
            value = local.to(spec.device, copy=True)
            p = spec.order
            if math.isinf(p):
                dist.all_reduce(value, op=dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN, group=spec.group)
            elif p == 0:
                dist.all_reduce(value, group=spec.group)
            else:
                value = value**p
                dist.all_reduce(value, group=spec.group)
                value = value ** (1.0 / p)
            t._memfit_reduced = value.to(local.device)
    return t._memfit_reduced


def _resolve(x: Any) -> Any:
    if isinstance(x, PartialNorm):
        return _reduced(x)
    if isinstance(x, list | tuple) and any(isinstance(t, PartialNorm) for t in x):
        return type(x)(_resolve(t) for t in x)
    return x


def _plain_call(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` as on plain tensors; partial norms among its arguments reduced first (metadata
    reads excepted: a shape, a dtype, a device need no collective)."""
    if getattr(func, "__name__", "") != "__get__" and func not in _METADATA:
        args = tuple(_resolve(a) for a in args)
        kwargs = {k: _resolve(v) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)
