"""Fully sharded data parallel (ZeRO-3) on torch.distributed collectives."""

from memfit.shard._api import FullyShardedDataParallel, clip_grad_norm_, shard, summon_full_params

__all__ = ["FullyShardedDataParallel", "clip_grad_norm_", "shard", "summon_full_params"]
