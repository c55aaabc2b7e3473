"""Fully sharded data parallel (ZeRO-3) on torch.distributed collectives."""

from memfit._shard._api import (
    FullyShardedDataParallel,
    clip_grad_norm_,
    load_full_state_dict,
    materialize,
    shard,
    summon_full_params,
)
from memfit._shard._export import export_safetensors
from memfit._shard._mixed import MixedPrecision
from memfit._shard._state import load_checkpoint, save_checkpoint

__all__ = [
    "FullyShardedDataParallel",
    "MixedPrecision",
    "clip_grad_norm_",
    "export_safetensors",
    "load_checkpoint",
    "load_full_state_dict",
    "materialize",
    "save_checkpoint",
    "shard",
    "summon_full_params",
]
