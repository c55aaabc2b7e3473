"""`memfit.checkpoint`: non-reentrant activation checkpointing on saved-tensor hooks."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit._checkpoint._cache import snapshot_caches
from memfit._checkpoint._offload import Offload, offload_hooks, resolve_offload
from memfit._checkpoint._replay import Replay
from memfit._checkpoint._selective import resolve_save, selective_context_fn, selective_contexts
from memfit._recompute import checkpointing_disabled, disable_checkpointing, is_recomputing, recomputing

__all__ = ["CheckpointError", "checkpoint", "disable_checkpointing", "is_recomputing"]


class CheckpointError(torch.utils.checkpoint.CheckpointError):
    """A checkpointed block cannot be recomputed faithfully (a subclass of torch's
    ``torch.utils.checkpoint.CheckpointError``, so code that catches torch's catches it)."""


class _StopRecompute(Exception):  # noqa: N818 (control flow, not an error)
    """Raised inside recompute once every saved tensor the backward needs is rebuilt."""


_anonymous_backward = itertools.count(-2, -1)  # graph ids for unpacks outside backward


def describe(fn: Callable) -> str:
    """A short name for error messages: the module class or the function's qualified name."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', 'forward')}"
    return getattr(fn, "__qualname__", None) or repr(fn)


class _SaveInputs(torch.autograd.Function):
    """Saves the block inputs as an autograd node would, so enclosing hooks apply to them."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise AssertionError("memfit: the input-saving node is never part of a backward pass")


class _Holder:
    """Placeholder autograd keeps instead of a saved tensor; filled by recompute."""

    __slots__ = ("__weakref__", "values")

    def __init__(self) -> None:
        self.values: dict[int, torch.Tensor] = {}  # graph task id -> recomputed tensor


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


def _fmt(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


# [Note: How a checkpointed call works]
# Forward: the block's inputs are saved once, through an autograd node (`_SaveInputs`), so
# that an enclosing checkpoint or offload hook sees them like any other saved tensor (this is
# what makes nested checkpoints and offloaded inputs work). The block then runs under
# `saved_tensors_hooks` whose pack hook keeps no tensor: it returns an empty `_Holder` and
# records the tensor's shape, dtype and device.
# Backward: the first unpack of any holder of the frame, per backward pass (graph task),
# re-runs the block on detached copies of its inputs under the forward's RNG and autocast
# state (see [Note: What recompute replays]). Its pack hook hands the i-th saved tensor to
# the i-th holder and stops the re-run (`_StopRecompute`) as soon as every holder is filled,
# so the tail of the block that produced nothing saved is not recomputed. Each holder's
# tensor is released as soon as autograd has unpacked it.
# Nothing is saved when nothing needs a gradient, so such a block is never recomputed.
class _Frame:
    """Everything one checkpointed call needs to recompute itself."""

    def __init__(
        self,
        fn: Callable,
        name: str,
        flat: list,
        spec,
        tensor_pos: list[int],
        replay: Replay,
        recompute_ctx,
        check: bool = True,
    ):
        self.fn = fn
        self.recompute_ctx = recompute_ctx  # selective recompute: replays the kept op outputs
        self.check = check  # compare each recomputed tensor's shape, dtype and device to forward's
        self.name = name
        self.flat = flat  # flattened (args, kwargs), tensors replaced by None
        self.spec = spec
        self.tensor_pos = tensor_pos  # where the tensors go back into `flat`
        self.slots: list[int] = []  # per position in tensor_pos: index of its distinct tensor
        self.requires_grad: list[bool] = []  # per distinct tensor
        self.attrs: list[dict | None] = []  # per distinct tensor: its Python attributes, if any
        self.replay = replay
        self.saver: torch.Tensor | None = None
        self.holders: list[weakref.ref] = []
        self.metas: list[tuple] = []
        self.filled: dict[int, int] = {}  # graph task id -> holders filled by its recompute

    def save_inputs(self, tensors: list[torch.Tensor]) -> None:
        # One saved tensor per distinct input: a tensor passed several times (self-attention's
        # query, key and value) is one object again in recompute, so the block takes the same path.
        index: dict[int, int] = {}
        distinct: list[torch.Tensor] = []
        for t in tensors:
            if id(t) not in index:
                index[id(t)] = len(distinct)
                distinct.append(t)
        self.slots = [index[id(t)] for t in tensors]
        self.requires_grad = [t.requires_grad for t in distinct]
        self.attrs = [dict(t.__dict__) or None for t in distinct]
        dummy = torch.empty(0, requires_grad=True)
        self.saver = _SaveInputs.apply(dummy, *distinct)

    def inputs(self) -> tuple[tuple, dict]:
        """The inputs for recompute: inputs that need no gradient as they were saved (the same
        objects unless offloaded), the others detached; Python attributes set on them kept."""
        assert self.saver is not None and self.saver.grad_fn is not None
        distinct = []
        saved_tensors = self.saver.grad_fn.saved_tensors  # type: ignore[attr-defined]  # a custom Function's node
        for saved, rg, attrs in zip(saved_tensors, self.requires_grad, self.attrs):
            t = saved.detach().requires_grad_(True) if rg else saved
            if attrs:
                t.__dict__.update(attrs)
            distinct.append(t)
        flat = snapshot_caches(self.flat)  # a fresh copy: see [Note: Key/value caches under recompute]
        for pos, slot in zip(self.tensor_pos, self.slots):
            flat[pos] = distinct[slot]
        return tree_unflatten(flat, self.spec)

    def pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        self.metas.append(_meta(t))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        gid = torch._C._current_graph_task_id()
        if gid == -1:  # unpacked outside a backward pass, e.g. by torch.autograd.graph inspection
            gid = next(_anonymous_backward)
        if gid not in self.filled:
            self.recompute(gid)
        try:
            return holder.values.pop(gid)
        except KeyError:
            raise CheckpointError(
                f"memfit.checkpoint({self.name}): a saved tensor was unpacked twice in one backward "
                "pass. Custom autograd functions inside a checkpointed block must read "
                "ctx.saved_tensors once per backward."
            ) from None

    def recompute(self, gid: int) -> None:
        self.filled[gid] = 0
        if gid >= 0:  # inside a backward pass: forget what it did not unpack when it ends
            # A weak reference: the callback must not keep the frame (and the block's inputs)
            # alive until the end of the backward pass.
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _forget(ref, gid))
        args, kwargs = self.inputs()
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack_recomputed(gid, t), _identity)
        try:
            with torch.enable_grad(), self.replay.context(), recomputing(), hooks, self.recompute_ctx:
                self.fn(*args, **kwargs)
        except _StopRecompute:
            pass
        except BaseException:
            del self.filled[gid]  # a later backward may retry
            raise
        if self.filled[gid] < len(self.holders):
            raise CheckpointError(
                f"memfit.checkpoint({self.name}): recompute saved {self.filled[gid]} tensors for "
                f"backward but the forward saved {len(self.holders)}. The block must take the same "
                "path in forward and recompute: avoid control flow on global state or on values "
                "that change between the two runs."
            )

    def forget(self, gid: int) -> None:
        """Drop backward pass ``gid``'s recomputed tensors that it did not use (a pass that
        reaches only part of the block, e.g. torch.autograd.grad on a retained graph)."""
        self.filled.pop(gid, None)
        for ref in self.holders:
            holder = ref()
            if holder is not None:
                holder.values.pop(gid, None)

    def pack_recomputed(self, gid: int, t: torch.Tensor) -> torch.Tensor:
        i = self.filled[gid]
        if i >= len(self.holders):  # unreachable with early stop; kept as a guard
            raise CheckpointError(
                f"memfit.checkpoint({self.name}): recompute saved more tensors than the forward ({len(self.holders)})."
            )
        if self.check and _meta(t) != self.metas[i]:
            raise CheckpointError(
                f"memfit.checkpoint({self.name}): recompute diverged from forward at saved tensor "
                f"#{i}: forward saved {_fmt(self.metas[i])}, recompute produced {_fmt(_meta(t))}. "
                "The block must compute the same shapes and dtypes when re-run: check for "
                "dependence on global state, and that inputs are not modified after the forward."
            )
        self.filled[gid] = i + 1
        value = t.detach() if t.requires_grad else t  # a tensor needing no grad: the same object
        holder = self.holders[i]()
        if holder is not None:  # None: autograd already released that part of the graph
            holder.values[gid] = value
        if i + 1 == len(self.holders):
            raise _StopRecompute
        # Detached: an op that saves its own output would otherwise hold a tensor whose
        # grad_fn is that op, a cycle through C++ that Python's GC cannot collect, leaking
        # the whole recomputed graph (and this frame) every step.
        return value


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _forget(ref: weakref.ref, gid: int) -> None:
    frame = ref()
    if frame is not None:
        frame.forget(gid)


def _module_of(fn: Callable) -> torch.nn.Module | None:
    """The module ``fn`` is, or is a bound method of (whose state offload keeps in place)."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _checkpoint(
    fn: Callable,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = True,
    offload: str | Offload | None = None,
    save: str | Callable | None = None,
    name: str | None = None,
    context_fn: Callable[[], tuple] | None = None,
    check: bool = True,
    module: torch.nn.Module | None = None,
):
    options: dict[str, Any] = {
        "preserve_rng_state": preserve_rng_state,
        "offload": offload,
        "save": save,
        "name": name,
        "context_fn": context_fn,
        "check": check,
        "module": module,
    }
    if torch.compiler.is_compiling():
        if offload is None:
            return _compiled_checkpoint(fn, args, kwargs, **options)
        return _eager_inside_compiled(fn, args, kwargs, **options)
    return _eager_checkpoint(fn, args, kwargs, **options)


def _eager_checkpoint(
    fn: Callable,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    offload: str | Offload | None,
    save: str | Callable | None,
    name: str | None,
    context_fn: Callable[[], tuple] | None,
    check: bool,
    module: torch.nn.Module | None,
):
    if not callable(fn):
        raise TypeError(f"memfit.checkpoint: expected a callable to checkpoint, got {type(fn).__name__}")
    offload = resolve_offload(offload)  # validated even when the call runs plainly
    save = resolve_save(save)
    if context_fn is not None and save is not None:
        raise ValueError("memfit.checkpoint: pass save= or context_fn=, not both (both choose what to keep)")
    if checkpointing_disabled() or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    module = module or _module_of(fn)
    if save == "all":  # nothing recomputed: only offload applies, to everything saved
        with offload_hooks(offload, module):
            return fn(*args, **kwargs)
    if context_fn is not None:
        forward_ctx, recompute_ctx = context_fn()
    elif save is not None:
        forward_ctx, recompute_ctx = selective_contexts(save)
    else:
        forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
    name = name or describe(fn)
    flat, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    tensors = [flat[i] for i in tensor_pos]
    frame = _Frame(
        fn,
        name,
        snapshot_caches([None if isinstance(x, torch.Tensor) else x for x in flat]),
        spec,
        tensor_pos,
        Replay(tensors, preserve_rng_state),
        recompute_ctx,
        check,
    )
    with offload_hooks(offload, module):
        frame.save_inputs(tensors)
    versions = [_version(t) for t in tensors]
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), forward_ctx:
        out = fn(*args, **kwargs)
    for k, (t, v) in enumerate(zip(tensors, versions)):
        if v is not None and _version(t) != v:
            raise CheckpointError(
                f"memfit.checkpoint({name}): tensor input #{k} {_fmt(_meta(t))} was modified in "
                "place inside the checkpointed block, so recompute would see a different value. "
                "Clone it inside the block before modifying it, or leave this block unchecked."
            )
    return out


def checkpoint(
    fn: Callable,
    *args,
    preserve_rng_state: bool = True,
    offload: str | Offload | None = None,
    save: str | Callable | None = None,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute the rest in backward.

    Non-reentrant (saved-tensor hooks): works with DistributedDataParallel, with blocks that
    run several times per step, with inputs or outputs that need no gradient (parameters used
    inside still get theirs), with keyword arguments and nested lists, tuples and dicts of
    tensors and other values, and nested inside other checkpointed calls. Under
    ``torch.no_grad``, inference mode or :func:`disable_checkpointing` it simply calls ``fn``.

    Args:
        fn: the block: a module, a function or any callable.
        preserve_rng_state: replay the CPU and input-device RNG state in recompute, so dropout
            masks are bitwise identical (autocast is replayed too, and norm layers' running
            statistics are updated once).
        offload: where the kept tensors wait for backward: None (in place), ``"cpu"``,
            ``"disk"`` or a :class:`memfit.Offload`. Parameters and views of them are never
            offloaded; ``"cpu"`` also keeps tensors under 1024 bytes, copies a tensor saved
            twice once and prefetches the next block's tensors in backward (see Offload).
        save: which op outputs to keep instead of recomputing: None (nothing: full
            recompute), ``"linear"`` (the outputs of Linear layers), ``"matmul"`` (every
            matmul, attention and convolution output), ``"all"`` or a callable(aten op) ->
            bool. Random ops (dropout) are always recomputed, with the replayed RNG.

    torch.utils.checkpoint's keywords are accepted, so memfit is a drop-in (they are never
    passed on to ``fn``):

    Args:
        use_reentrant: ``None`` or ``False`` (memfit is always non-reentrant); ``True`` raises
            ValueError.
        context_fn: torch's selective-checkpoint hook, a callable returning (forward context,
            recompute context), e.g. ``functools.partial(create_selective_checkpoint_contexts,
            policy)``; not together with ``save``.
        determinism_check: ``"default"`` (recompute must save tensors of the forward's shapes,
            dtypes and devices, else CheckpointError) or ``"none"`` (no such check).
        debug: accepted for compatibility; memfit's errors always name the block and the
            saved tensor where recompute diverged.

    Raises:
        CheckpointError: ``fn`` modifies a tensor input in place, or its recompute does not
            save the same number, shapes and dtypes of tensors as its forward.
    """
    return _checkpoint(
        fn,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        offload=offload,
        save=save,
        context_fn=context_fn,
        check=torch_compat(use_reentrant, determinism_check, debug, "memfit.checkpoint"),
    )


# [Note: Checkpointing under torch.compile]
# memfit's own mechanism (saved-tensor hooks that keep nothing, a recompute on first unpack)
# runs in eager autograd; a compiled region has its backward traced ahead of time, where those
# hooks cannot act. So while dynamo traces, a checkpointed call becomes torch's checkpoint
# higher-order op (the same as torch.utils.checkpoint under compile): the compiler's
# partitioner recomputes the region in backward, random ops included (their masks are
# replayed by the compiler), and a save= rule becomes torch's selective-checkpoint policy
# (the same rule function as in eager). Offload needs the eager hooks: an offloaded block is
# left out of the graph (a graph break on each side) and runs memfit's eager checkpoint.
_eager_inside_compiled = torch.compiler.disable(_eager_checkpoint)


def _compiled_checkpoint(fn, args, kwargs, *, preserve_rng_state, offload, save, name, context_fn, check, module):
    save = resolve_save(save)
    if save == "all":
        return fn(*args, **kwargs)
    if context_fn is None and save is not None:
        context_fn = selective_context_fn(save)
    return torch.utils.checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        determinism_check="default" if check else "none",
        **({"context_fn": context_fn} if context_fn is not None else {}),
        **kwargs,
    )


def torch_compat(use_reentrant: bool | None, determinism_check: str, debug: bool, where: str) -> bool:
    """Validate torch.utils.checkpoint's keywords; returns whether recompute is checked."""
    if use_reentrant:
        raise ValueError(
            f"{where}: use_reentrant=True is not supported: memfit is always non-reentrant (the "
            "mode torch recommends); pass use_reentrant=False or leave it out."
        )
    if determinism_check not in ("default", "none"):
        raise ValueError(f"{where}: determinism_check must be 'default' or 'none', got {determinism_check!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"{where}: debug must be a bool, got {debug!r}")
    return determinism_check == "default"
