"""Which modules are the blocks the planner decides for: the stacks that run on the batch, found
and watched call by call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from memfit._plan._step import Inputs, call


def _stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The stacks of layers: the children of a ModuleList (2 or more, whatever their classes:
    a hybrid alternates attention and state-space layers), and every longest run (2 or more)
    of consecutive same-class children of a Sequential (also inside a flat Sequential(stem,
    blocks..., head))."""
    stacks = []
    for path, m in model.named_modules():
        named = [(f"{path}.{n}" if path else n, k) for n, k in m.named_children()]
        if isinstance(m, nn.ModuleList) and len(named) >= 2:
            stacks.append(named)
        elif isinstance(m, nn.Sequential):
            run: list[tuple[str, nn.Module]] = []
            for n, k in [*named, ("", None)]:
                if run and (k is None or type(k) is not type(run[-1][1])):
                    if len(run) >= 2:
                        stacks.append(run)
                    run = []
                if k is not None:
                    run.append((n, k))
    return stacks


def _no_split_classes(model: nn.Module) -> set[str]:
    """The class names transformers models name in ``_no_split_modules`` (their layers)."""
    return {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}


# [Note: Default candidates]
# The candidates are the layers that run in the step, whatever their classes. The stacks are
# the ModuleLists of 2 or more modules and the runs of same-class modules in a Sequential.
# The planner traces one forward first and keeps the members that ran: a vision-language
# model's vision tower does not run on a text batch (and an image batch runs it first). Of
# those, a transformers model's layers are the stacks of the classes its _no_split_modules
# names (the units it never splits across devices); other models get the longest stack, with
# every other stack of the same classes or the same length (the encoder and the decoder of T5
# or BART; the four per-layer lists of XLM). Stacks inside a chosen module are left out, and
# the blocks are ordered as they first ran.
def find_candidates(model: nn.Module, ran: dict[str, int] | None = None) -> list[tuple[str, nn.Module]]:
    """Default candidates (see [Note: Default candidates]); ``ran``: the paths that ran in a
    forward on the example batch, each with its position in the order they first ran."""
    stacks = [r for s in _stacks(model) if (r := [(p, m) for p, m in s if ran is None or p in ran])]
    if not stacks:
        raise ValueError(
            f"memfit.plan: found no repeated blocks in {type(model).__name__} (two or more modules in a ModuleList, "
            "or of one class in a Sequential, that run on the example batch); pass candidates=[...] with the module "
            "paths of its blocks"
        )
    hinted = _no_split_classes(model)
    chosen = [s for s in stacks if all(type(m).__name__ in hinted for _, m in s)]
    if not chosen:
        classes = lambda s: {type(m) for _, m in s}  # noqa: E731
        best = max(stacks, key=len)
        chosen = [s for s in stacks if classes(s) == classes(best) or len(s) == len(best)]
    prefixes = [p for s in chosen for p, _ in s]
    inside = lambda path: any(path.startswith(p + ".") for p in prefixes)  # noqa: E731
    blocks = [(p, m) for s in chosen for p, m in s if not inside(p)]
    return sorted(blocks, key=lambda b: ran[b[0]]) if ran is not None else blocks


def _ran(model: nn.Module, inputs: Inputs, paths: list[str] | None, observer=None) -> dict[str, int]:
    """The candidate modules (``paths``, or every member of a stack) that run in a forward on
    ``inputs``, each with its position in the order they first ran. ``observer``: a context
    manager around that forward whose ``__enter__`` returns a callable given its output (the
    profile's check of the LM head watches the same forward: [Note: One forward, two checks])."""
    named = (
        [(p, model.get_submodule(p)) for p in paths] if paths is not None else [m for s in _stacks(model) for m in s]
    )
    order: dict[str, int] = {}

    def hook(path):
        def first_run(module, args, kwargs):
            order.setdefault(path, len(order))

        return first_run

    seen = contextlib.nullcontext(lambda out: None) if observer is None else observer
    with _watching([(m, hook(p), None) for p, m in named]), torch.no_grad(), seen as output:
        output(call(model, inputs))
    return order


class _Watched:
    """A block's forward, watched: ``pre(module, args, kwargs)`` before it and ``post(module,
    args, kwargs, out)`` after it, however it is called (SqueezeBERT calls its layers'
    ``forward`` directly, which module hooks do not see)."""

    def __init__(self, module: nn.Module, pre: Callable | None, post: Callable | None) -> None:
        self.inner = module.__dict__.get("forward")  # an instance forward (a checkpointed one) or None
        self.module, self.pre, self.post = module, pre, post

    def __call__(self, *args, **kwargs):
        if self.pre is not None:
            self.pre(self.module, args, kwargs)
        forward = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        out = forward(*args, **kwargs)
        if self.post is not None:
            self.post(self.module, args, kwargs, out)
        return out


class _ByCall:
    """Blocks by call: the k-th call of a module is the k-th block of its module in ``blocks``
    (a module run several times, ALBERT's shared layer, is one block per call; see [Note: A
    module run several times]). ``restart()`` before each step."""

    def __init__(self, blocks: list[nn.Module], pre: Callable, post: Callable) -> None:
        self.indices: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            self.indices.setdefault(id(b), []).append(i)
        self.modules = list({id(b): b for b in blocks}.values())
        self.pre_of, self.post_of = pre, post
        self.restart()

    def restart(self) -> None:
        self.calls: dict[int, int] = dict.fromkeys(self.indices, 0)
        self.running: dict[int, list[int | None]] = {k: [] for k in self.indices}

    def pre(self, module, args, kwargs) -> None:
        key, k = id(module), self.calls[id(module)]
        self.calls[key] = k + 1
        i = self.indices[key][k] if k < len(self.indices[key]) else None  # a call past those planned
        self.running[key].append(i)
        if i is not None:
            self.pre_of(i)(module, args, kwargs)

    def post(self, module, args, kwargs, out) -> None:
        i = self.running[id(module)].pop()
        if i is not None:
            self.post_of(i)(module, args, kwargs, out)


@contextlib.contextmanager
def _watching(watched):
    """Each (module, pre, post) watched (see _Watched) inside the block, then as it was; or,
    given a _ByCall, each of its modules, the hooks of the block each call is."""
    installed = []
    by_call = watched if isinstance(watched, _ByCall) else None
    if by_call is not None:
        watched = [(m, by_call.pre, by_call.post) for m in by_call.modules]
    try:
        for module, pre, post in watched:
            installed.append(_Watched(module, pre, post))
            module.forward = installed[-1]
        yield by_call
    finally:
        for w in reversed(installed):
            if w.inner is None:
                w.module.__dict__.pop("forward", None)
            else:
                w.module.forward = w.inner


# [Note: A module run several times]
# ALBERT runs one layer (one set of weights) N times. Without stacks of distinct layers, the
# candidates are the calls of the outermost module of a ModuleList that runs two or more times:
# each call is a block of the profile (its own kept bytes, its own moments, named "#k" after the
# path from the second call on), and all its calls take one decision (the module is checkpointed
# or not): the solver tries each decision for the module with the others solved as usual.
# Gradients of the module exist once, from the backward of its last call: counted with that
# call, none with the others (whose own backward profile still counts a gradient: above).
def _shared_calls(model: nn.Module, inputs: Inputs) -> list[str]:
    """The paths of the calls, in order, of the outermost ModuleList members that run two or
    more times in a forward on ``inputs`` (see [Note: A module run several times])."""
    members = [(f"{p}.{n}" if p else n, k) for p, m in model.named_modules() if isinstance(m, nn.ModuleList)
               for n, k in m.named_children()]  # fmt: skip
    order: list[str] = []

    def pre(path):
        def hook(module, args, kwargs):
            order.append(path)

        return hook

    with _watching([(m, pre(p), None) for p, m in members]), torch.no_grad():
        call(model, inputs)
    shared = {p for p in order if order.count(p) >= 2}
    outer = {p for p in shared if not any(p.startswith(q + ".") for q in shared)}
    return [p for p in order if p in outer]


def _candidate_paths(
    skeleton: nn.Module, inputs: Inputs, paths: list[str] | None, name: str, observer=None
) -> list[str]:
    """The candidates' paths in the order they run: the default ones, or those given, checked
    to run on the batch (see [Note: Default candidates]); ``observer``: as for ``_ran``."""
    ran = _ran(skeleton, inputs, paths, observer)
    if paths is None:
        try:
            return [p for p, _ in find_candidates(skeleton, ran)]
        except ValueError:
            if shared := _shared_calls(skeleton, inputs):
                return shared
            raise
    if missing := [p for p in paths if p not in ran]:
        raise ValueError(
            f"memfit.plan: candidates {missing} never run in {name}'s forward on the example batch; leave them "
            "out, or pass a batch that runs them"
        )
    return paths
