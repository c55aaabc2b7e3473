"""Fully sharded data parallel (ZeRO-3) on torch.distributed collectives."""

from memfit._shard._api import FullyShardedDataParallel, shard
from memfit._shard._deferred import load_full_state_dict, materialize
from memfit._shard._fully_shard import fully_shard
from memfit._shard._host_step import host_optimizer
from memfit._shard._mixed import MixedPrecision
from memfit._shard._options import ShardOptions
from memfit._shard._utils import clip_grad_norm_, summon_full_params

__all__ = [
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardOptions",
    "clip_grad_norm_",
    "fully_shard",
    "host_optimizer",
    "load_full_state_dict",
    "materialize",
    "shard",
    "summon_full_params",
]
