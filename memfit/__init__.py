"""memfit: train PyTorch models larger than your memory.

Activation checkpointing, a memory meter, and (in later releases) fully sharded data
parallel and a planner. Everything a user needs is re-exported here.
"""

from memfit.checkpoint import (
    CheckpointError,
    Offload,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_module,
    checkpoint_sequential,
    checkpoint_wrapper,
    disable_checkpointing,
    every_nth,
    is_recomputing,
    remove_checkpointing,
)
from memfit.memory import MemoryMeter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "MemoryMeter",
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
