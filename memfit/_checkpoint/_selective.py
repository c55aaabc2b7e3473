"""Selective (op-level) recompute: which op outputs a checkpointed block keeps."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# [Note: Selective recompute]
# A checkpointed block normally keeps only its inputs and recomputes everything. With a
# `save` rule it also keeps the outputs of the ops the rule selects, and recompute returns
# those instead of running the op again (Megatron-LM's selective recompute: keep what is
# expensive to compute, recompute what is cheap). The mechanism is torch's own
# (torch.utils.checkpoint.create_selective_checkpoint_contexts: a TorchDispatchMode caches the
# selected outputs in forward, another replays them in recompute). Ops that draw random
# numbers (dropout) or mutate their inputs, and factories whose output is filled in place
# (empty_like, zeros_like, ...), are always recomputed whatever the rule says: a cached random
# op would shift the random stream of every op after it in recompute, and a cached tensor
# that the block later mutates would be replayed with the mutated value.
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


def _always_recompute(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags or op._schema.is_mutable or op.overloadpacket in _FACTORIES


def selective_context_fn(save: str | Callable) -> Callable[[], tuple]:
    """torch's ``context_fn`` for a resolved rule other than None and "all": a callable giving
    (forward context, recompute context), as torch.utils.checkpoint and torch.compile take it."""
    keep = _READY[save] if isinstance(save, str) else save

    def policy(ctx, op, *args, **kwargs):
        if not _always_recompute(op) and keep(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)
