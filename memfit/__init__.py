"""memfit: train PyTorch models larger than your memory.

Activation checkpointing, a memory meter, fully sharded data parallel and a planner that
fits a training step into a memory budget. Everything a user needs is re-exported here.
"""

from memfit._checkpoint import (
    CheckpointError,
    Decision,
    DecisionKind,
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
from memfit._persist import export_safetensors, load_checkpoint, save_checkpoint
from memfit._plan import (
    AutoConfig,
    DeviceProfile,
    Plan,
    PlanError,
    autoconfigure,
    chunked_cross_entropy,
    parse_bytes,
    plan,
)
from memfit._shard import (
    FullyShardedDataParallel,
    MixedPrecision,
    ShardOptions,
    clip_grad_norm_,
    fully_shard,
    host_optimizer,
    load_full_state_dict,
    materialize,
    shard,
    summon_full_params,
)
from memfit.memory import MemoryMeter

__version__ = "0.1.0"

__all__ = [
    "AutoConfig",
    "CheckpointError",
    "Decision",
    "DecisionKind",
    "DeviceProfile",
    "FullyShardedDataParallel",
    "MemoryMeter",
    "MixedPrecision",
    "Offload",
    "Plan",
    "PlanError",
    "ShardOptions",
    "apply_activation_checkpointing",
    "autoconfigure",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "chunked_cross_entropy",
    "clip_grad_norm_",
    "disable_checkpointing",
    "every_nth",
    "export_safetensors",
    "fully_shard",
    "host_optimizer",
    "is_recomputing",
    "load_checkpoint",
    "load_full_state_dict",
    "materialize",
    "parse_bytes",
    "plan",
    "remove_checkpointing",
    "save_checkpoint",
    "shard",
    "summon_full_params",
]
