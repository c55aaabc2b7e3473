"""Activation checkpointing: function, sequential and module forms."""

from memfit._checkpoint._decision import Decision, DecisionKind
from memfit._checkpoint._function import CheckpointError, checkpoint, disable_checkpointing, is_recomputing
from memfit._checkpoint._module import (
    apply_activation_checkpointing,
    checkpoint_module,
    checkpoint_wrapper,
    every_nth,
    remove_checkpointing,
)
from memfit._checkpoint._offload import Offload
from memfit._checkpoint._sequential import checkpoint_sequential

__all__ = [
    "CheckpointError",
    "Decision",
    "DecisionKind",
    "Offload",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "every_nth",
    "is_recomputing",
    "remove_checkpointing",
]
