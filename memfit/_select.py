"""Which submodules: the one module-selection policy that activation checkpointing
(``apply_activation_checkpointing``), sharding (``auto_wrap_policy``) and the integrations read;
below both, as they share it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

# [Note: One module-selection policy]
# "Which submodules" is one value wherever memfit asks it: apply_activation_checkpointing's
# policy, FullyShardedDataParallel's and ShardOptions' auto_wrap_policy, the integrations'
# checkpointing= and options=. Each spelling means the same everywhere:
#   a module class, or a tuple, set, frozenset or list of them: the modules that are instances;
#   every_nth(n, classes): the 0th, n-th, 2n-th, ... of those in named_modules() order;
#   a callable(module) -> bool: the modules it returns True for;
#   an int: the modules with at least that many parameters (elements; sharding counts those
#     no unit below has taken);
#   torch's wrap policies (ModuleWrapPolicy, CustomPolicy, any _Policy) and old-style policy
#     callables fn(module, recurse, nonwrapped_numel) ([Note: Spellings from torch FSDP and
#     FairScale]): the modules they wrap, run once on the model (resolve).
# check() refuses anything else with one message naming the argument; a bool is refused apart
# (True is an int). An empty collection selects nothing: sharding takes it as "no units below
# the root" (empty_ok, as before the policies were joined); checkpointing refuses it, since
# checkpointing nothing is never what a caller of apply_activation_checkpointing meant.
# Each caller keeps what it does with the modules: checkpointing takes the
# outermost selected, sharding makes each a unit bottom-up.


@dataclass(frozen=True)
class every_nth:  # noqa: N801 (a policy that reads as a function call)
    """Policy for :func:`apply_activation_checkpointing`: every n-th module of ``classes``.

    Counts the matching modules in ``named_modules()`` order and selects the 0th, n-th,
    2n-th, ... (``every_nth(1, BertLayer)`` selects all of them).
    """

    n: int
    classes: type[nn.Module] | tuple[type[nn.Module], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"memfit.every_nth: n must be an integer >= 1, got {self.n!r}")
        _check_classes(self.classes, "every_nth")

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        matches = [(n, m) for n, m in model.named_modules() if isinstance(m, self.classes)]
        return matches[:: self.n]


def _check_classes(classes, where: str) -> None:
    items = classes if isinstance(classes, tuple) else (classes,)
    if not items or not all(isinstance(c, type) for c in items):
        raise TypeError(f"memfit.{where}: expected a module class or a tuple of module classes, got {classes!r}")


_COLLECTIONS = (tuple, set, frozenset, list)


def check(policy: Any, where: str, arg: str, *, empty_ok: bool = False) -> None:
    """Refuse what no spelling of a module-selection policy is (None: none given; ``empty_ok``:
    an empty collection is a policy that selects nothing)."""
    if isinstance(policy, bool):
        raise TypeError(
            f"{where}: {arg} must not be a bool; pass a module class, classes or a callable(module) -> bool"
        )
    if isinstance(policy, int) and policy < 0:
        raise ValueError(f"{where}: {arg}={policy}; an int is a minimum parameter count (>= 0)")
    empty = isinstance(policy, _COLLECTIONS) and not policy
    if empty and empty_ok:
        return
    if isinstance(policy, _COLLECTIONS) and (empty or not all(isinstance(c, type) for c in policy)):
        raise TypeError(
            f"{where}: {arg} must be a module class or a tuple of module classes (or a set, a list), got {policy!r}"
        )
    if not (policy is None or isinstance(policy, (int, every_nth, *_COLLECTIONS)) or callable(policy)):
        if not _is_torch_policy(policy):
            raise TypeError(
                f"{where}: {arg} must be a module class, a tuple of module classes (or a set, a list), "
                f"memfit.every_nth(n, classes), a callable(module) -> bool, an int (minimum parameters), "
                f"torch's wrap policy, or None; got {policy!r}"
            )


def resolve(policy: Any, root: nn.Module) -> Any:
    """``policy`` with the spellings that need the model (torch's policy objects, old-style
    policy callables, every_nth) run once on ``root``: the set of modules they select, as a
    predicate; the others as they are."""
    if _is_torch_policy(policy):
        targets = set(policy._run_policy(root, set(), {}))
        targets.discard(root)
        return targets.__contains__
    if isinstance(policy, every_nth):
        return {m for _, m in policy.select(root)}.__contains__
    if callable(policy) and not isinstance(policy, type) and _takes_recurse(policy):
        return set(_walk_old_style(root, policy)).__contains__
    return policy


def predicate(
    policy: Any,
    where: str,
    arg: str,
    numel: Callable[[nn.Module], int] | None = None,
    *,
    empty_ok: bool = False,
) -> Callable[[nn.Module], bool]:
    """Whether a module is selected by ``policy`` (resolved: see :func:`resolve`); ``numel``:
    the parameters an int policy counts (default: all of the module's); ``empty_ok``: see
    :func:`check`."""
    check(policy, where, arg, empty_ok=empty_ok)
    if policy is None:
        return lambda m: False
    if isinstance(policy, int):
        count = numel or (lambda m: sum(p.numel() for p in m.parameters()))
        return lambda m: count(m) >= policy
    if isinstance(policy, type):
        return lambda m: isinstance(m, policy)
    if isinstance(policy, _COLLECTIONS):
        classes = tuple(policy)
        return lambda m: isinstance(m, classes)
    return cast("Callable[[nn.Module], bool]", policy)


def select(policy: Any, model: nn.Module, where: str, arg: str) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module of ``model`` that ``policy`` selects, in named_modules()
    order (``""``: the model itself)."""
    if isinstance(policy, every_nth):
        return policy.select(model)
    chosen = predicate(resolve(policy, model), where, arg)
    return [(n, m) for n, m in model.named_modules() if chosen(m)]


def _is_torch_policy(policy: Any) -> bool:
    try:
        from torch.distributed.fsdp.wrap import _Policy
    except ImportError:  # torch built without distributed
        return False
    return isinstance(policy, _Policy)


def _takes_recurse(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _walk_old_style(root: nn.Module, policy: Callable) -> list[nn.Module]:
    """The modules torch's ``_recursive_wrap`` would wrap with ``policy``, children first."""
    targets: list[nn.Module] = []

    def numel(m: nn.Module, wrapped: set) -> int:
        return sum(p.numel() for p in m.parameters() if p not in wrapped)

    wrapped: set[nn.Parameter] = set()

    def visit(m: nn.Module) -> None:
        if not policy(module=m, recurse=True, nonwrapped_numel=numel(m, wrapped)):
            return
        for child in m.children():
            visit(child)
        if m is not root and policy(module=m, recurse=False, nonwrapped_numel=numel(m, wrapped)):
            targets.append(m)
            wrapped.update(m.parameters())

    visit(root)
    return targets
