"""Selective (op-level) recompute: which op outputs a checkpointed block keeps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# [Note: Selective recompute]
# A checkpointed block normally keeps only its inputs and recomputes everything. With a
# `save` rule it also keeps the outputs of the ops the rule selects, and recompute returns
# those instead of running the op again (Megatron-LM's selective recompute: keep what is
# expensive to compute, recompute what is cheap). The mechanism is torch's (a TorchDispatchMode
# caches the selected outputs in forward, another replays them in recompute): under
# torch.compile, torch.utils.checkpoint.create_selective_checkpoint_contexts itself; in eager,
# memfit's own pair of modes with the same semantics (see [Note: The cost of selective
# recompute]). Ops that draw random
# numbers (dropout) or mutate their inputs, and factories whose output is filled in place
# (empty_like, zeros_like, ...), are always recomputed whatever the rule says: a cached random
# op would shift the random stream of every op after it in recompute, and a factory's output
# is mutated by the block (kept, it would be held only to be recomputed: see [Note: The cost of
# selective recompute]).
#
# Ready rules:
#   None / "nothing"  keep nothing: full recompute (the default).
#   "linear"          keep the outputs of 2-D matrix multiplies (nn.Linear: addmm, mm); recompute
#                     the attention core (batched matmuls, softmax, dropout), norms, activations.
#   "matmul"          keep every matrix multiply, attention kernel and convolution output.
#   "all"             keep everything: the block is not recomputed at all (with offload, this
#                     moves everything the block saves for backward to the offload target).
# A callable `save(op) -> bool` receives the aten OpOverload (e.g. torch.ops.aten.addmm.default).

aten = torch.ops.aten

_LINEAR = {aten.addmm, aten.mm, aten.linear}
_MATMUL = _LINEAR | {
    aten.bmm,
    aten.baddbmm,
    aten.matmul,
    aten.convolution,
    aten._convolution,
}
_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_MATMUL |= {getattr(aten, n) for n in _ATTENTION_NAMES if hasattr(aten, n)}

RULES = ("nothing", "linear", "matmul", "all")


def _packet_rule(packets: set) -> Callable[[torch._ops.OpOverload], bool]:
    return lambda op: op.overloadpacket in packets


_READY = {"linear": _packet_rule(_LINEAR), "matmul": _packet_rule(_MATMUL)}


def resolve_save(save) -> str | Callable | None:
    """Validate ``save``: None, a rule name or a callable; "nothing" becomes None."""
    if save is None or save == "nothing":
        return None
    if isinstance(save, str):
        if save not in RULES:
            raise ValueError(f"memfit: unknown save rule {save!r}; choose one of {RULES} or a callable(op) -> bool")
        return save
    if callable(save):
        return save
    raise TypeError(f"memfit: save must be None, one of {RULES} or a callable(op) -> bool, got {save!r}")


# Outputs made to be filled in place (dropout draws its mask into an empty_like): keeping
# one would keep a tensor that the block then mutates.
_FACTORIES = {
    aten.empty_like,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.new_empty,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.empty,
    aten.empty_strided,
}


_ALWAYS_RECOMPUTE: dict = {}  # op -> whether it is recomputed whatever the rule says (a pure function of op)


def _always_recompute(op) -> bool:
    # Cached: `op.tags` builds a list and `op._schema` a schema object on every access, a few
    # microseconds per op that every op of a selective block paid twice (forward and recompute).
    found = _ALWAYS_RECOMPUTE.get(op)
    if found is None:
        found = _ALWAYS_RECOMPUTE[op] = (
            torch.Tag.nondeterministic_seeded in op.tags or op._schema.is_mutable or op.overloadpacket in _FACTORIES
        )
    return found


def selective_context_fn(save: str | Callable) -> Callable[[], tuple]:
    """torch's ``context_fn`` for a resolved rule other than None and "all": a callable giving
    (forward context, recompute context), as torch.utils.checkpoint and torch.compile take it."""
    keep = _READY[save] if isinstance(save, str) else save

    def policy(ctx, op, *args, **kwargs):
        if not _always_recompute(op) and keep(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


# [Note: The cost of selective recompute]
# A dispatch mode sees every aten op of the block, in forward and again in recompute: on an
# accelerator under bf16 the step is bound by the host's time to launch ops, so what the mode
# does per op is what selective recompute costs over full recompute. torch's modes (which
# memfit's eager path used before) spend per op: a dynamo-disable wrapper around
# __torch_dispatch__, two "are we compiling" probes, a storage key resolved through an import,
# a SelectiveCheckpointContext, the policy call (memfit's rule read `op.tags` and
# `op._schema`, building both each time), and a tree_map over every output, kept or not.
# memfit's eager modes do one dict lookup per op that is not kept (the decision per op is
# cached: for the ready rules process-wide, for a callable rule per block call, so the callable
# is asked once per distinct op of the block) and the tree work only for the ops kept.
# The semantics are torch's: the kept outputs are stored detached, per op in call order, and
# recompute returns the n-th stored output at the op's n-th call; each is handed out once (a
# second recompute of the same forward, e.g. backward twice with retain_graph=True, is an error,
# as in torch); what recompute did not take (it stops early) is dropped when it ends. One
# difference: a stored output modified in place since forward (its version counter moved:
# Swinv2's nn.ReLU(inplace=True) right after a Linear, or code after the block writing to it) is
# not an error but recomputed: the op runs again on its recomputed inputs, which are forward's,
# so it gives forward's output bitwise, as full recompute would. torch raises there ("Tensor
# cached during selective activation checkpoint has been mutated") or, with
# allow_cache_entry_mutation=True, hands back the mutated value. A write that moves no version
# counter (through `.data`) goes unseen here as in torch.

_IGNORED = {  # never kept nor counted (torch's SAC_IGNORED_OPS): their number differs between the runs
    aten.detach.default,
    torch.ops.prim.device.default,
}
_CONSUMED = object()


class _Decisions:
    """Whether each op's outputs are kept, by ``id(op)``: an OpOverload's __hash__ is a Python
    method, ``id`` is not. The ops are held (``ops``), so no id is reused while it is cached."""

    __slots__ = ("ask", "kept", "ops")

    def __init__(self, ask: Callable) -> None:
        self.ask = ask
        self.kept: dict[int, bool] = {}
        self.ops: list = []

    def decide(self, op) -> bool:
        kept = op not in _IGNORED and not _always_recompute(op) and bool(self.ask(op))
        self.ops.append(op)
        self.kept[id(op)] = kept
        return kept


def _decisions(save: str | Callable) -> _Decisions:
    """Process-wide for the ready rules (they are fixed); per block call for a callable."""
    if isinstance(save, str):
        found = _READY_DECISIONS.get(save)
        if found is None:
            found = _READY_DECISIONS[save] = _Decisions(_READY[save])
        return found
    return _Decisions(save)


_READY_DECISIONS: dict[str, _Decisions] = {}  # per fixed rule, its decisions: they never change


def _detach(x: torch.Tensor) -> torch.Tensor:
    # As torch's _detach_helper: a view op's output must come back from recompute without
    # autograd metadata, and with its version counter propagated below autograd.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _versions(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value._version]
    out: list[int] = []
    tree_map_only(torch.Tensor, lambda t: out.append(t._version), value)
    return out


class _Kept:
    """One kept op output, detached, and the versions of its tensors."""

    __slots__ = ("value", "versions")

    def __init__(self, value: Any) -> None:
        self.value = _detach(value) if isinstance(value, torch.Tensor) else tree_map_only(torch.Tensor, _detach, value)
        self.versions = _versions(self.value)

    def modified(self) -> bool:
        """Whether a tensor of it was modified in place since forward kept it."""
        return _versions(self.value) != self.versions


class _Storage:
    """What a selective block kept in forward: per op (by id), its kept outputs in call order."""

    __slots__ = ("decisions", "kept")

    def __init__(self, save: str | Callable) -> None:
        self.decisions = _decisions(save)
        self.kept: dict[int, list] = {}


class _Lean(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no dynamo-disable wrapper per op: see the Note
        return False


class _SaveMode(_Lean):
    """Forward: runs every op; keeps the outputs of the ops the rule selects."""

    def __init__(self, storage: _Storage) -> None:
        super().__init__()
        self.storage = storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        storage = self.storage
        kept = storage.decisions.kept.get(id(func))
        if kept is None:
            kept = storage.decisions.decide(func)
        if kept:
            storage.kept.setdefault(id(func), []).append(_Kept(out))
        return out


class _ReplayMode(_Lean):
    """Recompute: the kept ops return their forward outputs (each once); the others run."""

    def __init__(self, storage: _Storage) -> None:
        super().__init__()
        self.storage = storage
        self.calls: dict[int, int] = {}  # by id(op)

    def __enter__(self):
        self.calls = {}
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        # Recompute stops once backward has what it needs: the kept outputs it did not reach
        # are not needed by this backward, and a second recompute is an error anyway.
        for outputs in self.storage.kept.values():
            outputs[:] = [_CONSUMED] * len(outputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = id(func)
        outputs = self.storage.kept.get(key)
        if outputs is None:  # not kept (or kept never): run it
            if self.storage.decisions.kept.get(key, False):
                raise RuntimeError(
                    f"memfit selective recompute: {func} ran in recompute but not in forward; the block must "
                    "take the same path in forward and recompute"
                )
            return func(*args, **kwargs) if kwargs else func(*args)
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        if n >= len(outputs):
            raise RuntimeError(
                f"memfit selective recompute: {func} ran {n + 1} times in recompute but {len(outputs)} in "
                "forward; the block must take the same path in forward and recompute"
            )
        entry = outputs[n]
        if entry is _CONSUMED:
            raise RuntimeError(
                "memfit selective recompute: a block's kept outputs are used by one backward only. Trying to "
                "backward an extra time: you are only allowed to backward once on any region computed under "
                "selective activation checkpoint."
            )
        outputs[n] = _CONSUMED
        if entry.modified():  # recomputed: see [Note: The cost of selective recompute]
            return func(*args, **kwargs) if kwargs else func(*args)
        return entry.value


def selective_contexts(save: str | Callable) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """memfit's eager (forward mode, recompute mode) for a resolved rule other than None and "all"."""
    storage = _Storage(save)
    return _SaveMode(storage), _ReplayMode(storage)
