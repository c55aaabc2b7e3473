"""Deferred initialisation: values for a sharded model built on the meta device, one unit or
one tensor at a time, so the full model never exists on one rank."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard._collectives import free_now
from memfit._shard._device import device_of_units, fill, moved
from memfit._shard._unit import Unit, units_of, user_class

__all__ = ["load_full_state_dict", "materialize"]


# [Note: What materialize initialises]
# A model built on the meta device has no values, and memfit allocates each unit's full
# parameters without filling them, so every tensor must be written by something that knows the
# model's init. Per unit (the unit's full parameters allocated, the same seed on every rank, so
# every rank computes the same full values and keeps its rows), each module the unit manages,
# children before parents (as transformers' `initialize_weights` walks them):
# - `init=` / `param_init_fn=` given: `init(module)` and nothing else;
# - else its own `reset_parameters()` when it has one (what its constructor would have done),
#   then, inside a transformers model, the `_init_weights(module)` of the nearest enclosing
#   `PreTrainedModel` (what `from_config` does eagerly: embeddings std `initializer_range`,
#   norms 1, biases 0, GPT-2's scaled residual projections, rotary and position buffers).
#   Tied parameters are untied while their unit initialises (the tied copy gets a scratch
#   tensor): transformers initialises before it ties, so the eager value is the source's init
#   (the input embedding's std, not the output head's). A source outside the unit that owns the
#   tensor is initialised there with its other tensors set aside; a source that nothing writes
#   (its constructor's value, lost on the meta device: a tied bias) takes the copy's init.
# Before that the tensors to fill (deferred parameters, and buffers built on the meta device,
# which sharding zeroed) are set to NaN (integer buffers: their version counter is noted);
# afterwards any still NaN somewhere (or, integer, never written) is an error naming the module
# and the tensor and saying what to pass. One host sync per unit, for that check.


_META_BUFFERS = "_memfit_meta_buffers"  # names of a module's buffers built on the meta device


@torch.no_grad()
def materialize(
    model: nn.Module,
    init: Callable[[nn.Module], None] | None = None,
    seed: int = 0,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give the parameters (and buffers) built on the meta device their initial values, one
    unit at a time: the unit's full parameters are allocated, each module it manages is
    initialised under the same seed on every rank, each rank keeps its rows, and the full
    parameters are freed. No communication; the peak is the local chunks plus one unit in full.

    A module is initialised by ``init(module)`` when given (``param_init_fn`` is FSDP1's name
    for it), else by its ``reset_parameters()`` and, inside a transformers model, by that
    model's own ``_init_weights(module)``. A parameter or buffer that nothing writes is an
    error naming it (See [Note: What materialize initialises])."""
    if param_init_fn is not None:
        if init is not None:
            raise TypeError("memfit.materialize: pass init= or param_init_fn= (the same thing), not both")
        init = param_init_fn
    hf = _hf_owners(model) if init is None else {}
    ties = _ties(model) if hf else []
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    for i, unit in enumerate(units_of(model)):
        todo = [sp for sp in unit.params if sp.deferred]
        buffers = [(m, n) for m in unit.managed for n in getattr(m, _META_BUFFERS, ())]
        if not todo and not buffers:
            continue
        torch.manual_seed(seed * 1_000_003 + i)  # the same values on every rank
        for sp in unit.params:
            sp.alloc_full()
            sp.register(sp.full)
        try:
            before = [cast(torch.Tensor, m._buffers[n]) for m, n in buffers]  # meta buffers: tensors
            marks = [_mark(sp.full) for sp in todo] + [_mark(b) for b in before]
            _init_unit(unit, init, hf, ties)
            replaced = _take_replaced(todo, buffers, before)
            _refuse_unwritten(todo, buffers, marks, replaced, paths, init is not None, hf)
            for sp in todo:
                sp.keep_rows(sp.full, unit.rank)
                sp.deferred = False
            for m, n in buffers:
                getattr(m, _META_BUFFERS).discard(n)
        finally:
            for sp in unit.params:
                sp.register(sp.sharded)
                sp.free_full()
    return model


def _init_unit(unit: Unit, init, hf: dict[int, nn.Module], ties: list[_Tie]) -> None:
    """Initialise the modules of ``unit`` (its full parameters registered), untying the tied
    parameters it owns meanwhile (See [Note: What materialize initialises])."""
    if init is not None:
        for m in _children_first(unit):
            init(m)
        return
    owned = {id(sp.full) for sp in unit.params}
    untie = [t for t in ties if id(t.target._parameters.get(t.target_name)) in owned]
    with contextlib.ExitStack() as stack:
        copies = [
            (getattr(t.target, t.target_name), stack.enter_context(_scratch(t.target, {t.target_name}))) for t in untie
        ]
        for m, aside in _visits(unit, untie):
            with _scratch(m, aside):
                if hasattr(m, "reset_parameters") and (m._parameters or m._buffers):
                    m.reset_parameters()  # type: ignore[operator]
                owner = hf.get(id(m))
                if owner is not None:
                    owner._init_weights(m)  # type: ignore[operator]
    _fill_from_copies([(param, scratch[t.target_name]) for t, (param, scratch) in zip(untie, copies)])


def _hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the nearest transformers ``PreTrainedModel`` containing it (itself included),
    for the modules inside one; {} when transformers is not in use."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None:
        return {}
    owners: dict[int, nn.Module] = {}

    def visit(m: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(m, pretrained):
            owner = m
        if owner is not None:
            owners.setdefault(id(m), owner)
        for child in m.children():
            visit(child, owner)

    visit(model, None)
    return owners


class _Tie(NamedTuple):
    """``target.target_name`` is the same parameter as ``source.source_name`` (transformers' tying)."""

    target: nn.Module
    target_name: str
    source: nn.Module
    source_name: str


def _ties(model: nn.Module) -> list[_Tie]:
    """The tied parameters of every transformers model inside ``model`` (each one's
    ``all_tied_weights_keys``, target -> source), where the two are the same tensor."""
    out = []
    for owner in model.modules():
        for target, source in (getattr(owner, "all_tied_weights_keys", None) or {}).items():
            t_mod, _, t_name = target.rpartition(".")
            s_mod, _, s_name = source.rpartition(".")
            try:
                tm, sm = owner.get_submodule(t_mod), owner.get_submodule(s_mod)
            except AttributeError:
                continue
            t = tm._parameters.get(t_name)
            if t is not None and t is sm._parameters.get(s_name) and tm is not sm:
                out.append(_Tie(tm, t_name, sm, s_name))
    return out


def _visits(unit, ties: list[_Tie]) -> list[tuple[nn.Module, set[str]]]:
    """The modules to initialise for ``unit``, children first, each with the names of tensors its
    init must not write (set aside): none for the unit's own; then the source modules outside the
    unit of the tied parameters it owns (``ties``), each with all but that parameter set aside."""
    out: list[tuple[nn.Module, set[str]]] = [(m, set()) for m in _children_first(unit)]
    managed = {id(m) for m in unit.managed}
    for t in ties:
        if id(t.source) not in managed:
            others = set(t.source._parameters) | set(t.source._buffers)
            out.append((t.source, {n for n in others if n != t.source_name and getattr(t.source, n) is not None}))
    return out


@contextlib.contextmanager
def _scratch(module: nn.Module, names: set[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Give ``module`` NaN-filled throwaway tensors for ``names`` while it initialises; yields them."""
    saved: dict[str, torch.Tensor] = {n: getattr(module, n) for n in names}
    scratch = {
        n: torch.full_like(t, float("nan")) if t.is_floating_point() else torch.empty_like(t) for n, t in saved.items()
    }
    for n, t in scratch.items():
        if n in module._parameters:
            module._parameters[n] = nn.Parameter(t, requires_grad=saved[n].requires_grad)
        else:
            module._buffers[n] = t
    try:
        yield scratch
    finally:
        for n, t in saved.items():
            if n in module._parameters:
                module._parameters[n] = t  # type: ignore[assignment]
            else:
                module._buffers[n] = t


def _fill_from_copies(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A tied parameter its source module left unwritten (its value came from the source's
    constructor, lost on the meta device) takes what its copy's module wrote, when that is whole."""
    for param, copy in copies:
        if (
            param.is_floating_point()
            and not param.is_meta
            and bool(param.isnan().all())
            and not bool(copy.isnan().any())
        ):
            param.copy_(copy)


def _children_first(unit) -> list[nn.Module]:
    """The unit's managed modules, each after its children (post-order, siblings in order)."""
    managed = {id(m) for m in unit.managed}
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in managed and id(child) not in seen:
                visit(child)
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)

    visit(unit.module)
    out.extend(m for m in unit.managed if id(m) not in seen)
    return out


def _mark(t: torch.Tensor) -> int:
    """Make ``t`` recognisably unwritten: NaN when floating point; returns its version counter."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    return t._version


def _take_replaced(todo: list, buffers: list[tuple[nn.Module, str]], before: list[torch.Tensor]) -> set[int]:
    """Keep the values of parameters an init replaced (``module.weight = nn.Parameter(...)``, or
    its ``.data``) in the full parameter, and put replaced buffers where the originals were; returns the indices
    (parameters, then buffers) of the replaced ones."""
    replaced = set()
    for i, sp in enumerate(todo):
        if sp.full.untyped_storage().data_ptr() != sp._padded.untyped_storage().data_ptr():
            # `module.to_empty(recurse=False)` (FSDP1's usual param_init_fn) set `.data`: the
            # values go back into the storage the gathers fill (See [Note: Sharded parameter layout]).
            values = sp.full.data
            sp.full.data = sp._padded[: values.numel()].view(sp.shape)
            sp.full.copy_(values.to(sp.full.device))
        for m, name in sp.uses:
            new = m._parameters.get(name)
            if new is not None and new is not sp.full:
                sp.full.copy_(new.detach())
                replaced.add(i)
                break
    for j, ((m, name), old) in enumerate(zip(buffers, before)):
        b = cast(torch.Tensor, m._buffers[name])
        if b is not old:
            m._buffers[name] = b.to(device=old.device)
            replaced.add(len(todo) + j)
    return replaced


def _refuse_unwritten(todo, buffers, marks, replaced: set[int], paths, custom: bool, hf: dict) -> None:
    tensors = [sp.full for sp in todo] + [m._buffers[n] for m, n in buffers]
    names = [(sp.uses[0][0], sp.uses[0][1], "parameter") for sp in todo] + [(m, n, "buffer") for m, n in buffers]
    if any(t.is_meta for t in tensors):  # a unit computing on the meta device (tests): no values to check
        return
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
    # One host sync for the unit: NaN anywhere survives the sum (the marks of unwritten elements).
    nan = torch.stack([tensors[i].sum(dtype=torch.float32).isnan() for i in floats]).tolist() if floats else []
    unwritten = [i for i, bad in zip(floats, nan) if bad]
    unwritten += [i for i, t in enumerate(tensors) if i not in floats and t._version == marks[i]]
    unwritten = [i for i in unwritten if i not in replaced]
    if not unwritten:
        return
    where = []
    for i in sorted(unwritten):
        m, n, kind = names[i]
        path = paths.get(id(m), "?")
        where.append(f"{kind} '{f'{path}.{n}' if path else n}' of {user_class(m).__name__}")
    if custom:
        how = "the init function passed to materialize left them (or some of their elements) unset: make it fill them"
    else:
        hf_note = " and the transformers model's _init_weights does not set them" if hf else ""
        how = (
            f"their modules have no reset_parameters{hf_note}; pass memfit.materialize(model, init=fn) with "
            "fn(module) filling every parameter and buffer of the modules it is given (in place), or give the "
            "module classes a reset_parameters()"
        )
    raise RuntimeError(f"memfit.materialize: nothing initialised {', '.join(where[:10])}: {how}")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> nn.Module:
    """Load full tensors held by rank 0 (``state_dict``; other ranks pass None) into a sharded
    model, streamed one tensor at a time: rank 0 broadcasts it on the compute device (where
    NCCL takes it), every rank keeps its rows. No rank holds more than its chunks plus one
    full tensor beyond what rank 0 already has."""
    units = units_of(model)
    group = units[0].layout.everyone  # rank 0 of all ranks holds it, whatever the replicas
    device = device_of_units(units)
    src = dist.get_global_rank(group, 0)
    shards = {id(sp.sharded): sp for u in units for sp in u.params}
    rank = dist.get_rank(group)
    names = list(model.state_dict(keep_vars=True).items())
    # Checked on rank 0 before any broadcast, and shared, so no rank waits in vain.
    full = cast("dict[str, torch.Tensor]", state_dict)  # rank 0's, read only there (None elsewhere)
    box = [_mismatch(names, full, shards) if rank == 0 else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0]:
        raise RuntimeError(f"memfit.load_full_state_dict: the state dict does not match the model: {box[0]}")
    done: set[int] = set()
    for name, t in names:
        if id(t) in done:  # tied: loaded once
            continue
        done.add(id(t))
        sp = shards.get(id(t))
        shape = sp.shape if sp is not None else t.shape
        if rank == 0:
            buf = moved(full[name].detach().to(t.dtype), device, copy=True)
        else:
            buf = torch.empty(shape, dtype=t.dtype, device=device)
        if rank == 0 and tuple(buf.shape) != tuple(shape):
            raise RuntimeError(
                f"memfit.load_full_state_dict: '{name}' is {list(buf.shape)}, the model has {list(shape)}"
            )
        dist.broadcast(buf, src=src, group=group)
        if sp is not None:
            sp.keep_rows(buf, cast(Unit, sp.owner).rank)
            sp.deferred = False
        else:
            fill(t, buf)
        if buf.device.type == "cpu":
            free_now(buf)
    return model


def _mismatch(names: list[tuple[str, torch.Tensor]], state_dict: dict[str, torch.Tensor], shards: dict) -> str | None:
    """What keeps ``state_dict`` from loading into the model (missing, unexpected keys, shapes), or None."""

    def full_shape(t):
        sp = shards.get(id(t))
        return tuple(sp.shape) if sp is not None else tuple(t.shape)

    missing = [n for n, _ in names if n not in state_dict]
    unexpected = [n for n in state_dict if n not in dict(names)]
    shapes = [
        f"'{n}' is {list(state_dict[n].shape)}, the model has {list(full_shape(t))}"
        for n, t in names
        if n in state_dict and tuple(state_dict[n].shape) != full_shape(t)
    ]
    if missing or unexpected or shapes:
        return f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; {'; '.join(shapes[:5])}"
    on_meta = [n for n, _ in names if n in state_dict and state_dict[n].is_meta]
    if on_meta:
        return f"tensors on the meta device (no values to load): {on_meta[:10]}"
    return None
