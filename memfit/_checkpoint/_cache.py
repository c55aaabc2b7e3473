"""Key/value caches passed into a checkpointed call: recompute sees them as forward did."""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

# [Note: Key/value caches under recompute]
# A transformers layer given a key/value cache (a `transformers.cache_utils.Cache`) appends its
# keys and values to it in forward, and would again in recompute: the replayed layer then sees
# twice the keys (a recompute that diverges from forward: full recompute computes other values,
# selective recompute fails in backward, "aten.slice encountered during backward but not found
# in storage"). Some models build a cache even in training (XLM's forward makes one whenever it
# is given none). So a checkpointed call keeps, at its start, a snapshot of every Cache among
# its arguments: the same objects' structure (its layers, lists, dicts and counters copied) over
# the same key and value tensors (shared, not copied: a DynamicCache's update replaces them
# rather than writing into them). Each recompute runs on a fresh copy of that snapshot, so it
# appends to a throwaway cache in the state forward saw, and the cache the model holds is
# updated once, by forward, as without checkpointing. Counters stored as one-element tensors
# (a static cache's length) are copied too; a static cache's keys and values, written in place
# at the positions that counter gives, are written again with the same values.
# In training, layers whose class declares `_can_checkpoint_with_cache = False` get no cache
# at all (transformers' own rule for its GradientCheckpointingLayer; see _module.py): the cache
# would hold every layer's keys and values until the step ends, memory the planner does not
# forecast.


def cache_type() -> type | None:
    """transformers' Cache base class, when transformers is imported (never imported here)."""
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def snapshot_caches(flat: list) -> list:
    """``flat`` with every transformers Cache replaced by a snapshot of its present state."""
    cache = cache_type()
    if cache is None or not any(isinstance(x, cache) for x in flat):
        return flat
    return [_copy(x, {}) if isinstance(x, cache) else x for x in flat]


def _copy(x, memo: dict):
    """A copy of the cache object ``x``: containers and Python objects copied, tensors shared
    (one-element tensors, counters, cloned)."""
    if id(x) in memo:
        return memo[id(x)]
    out: Any = x
    if isinstance(x, torch.Tensor):
        out = x.clone() if x.numel() <= 1 else x
    elif type(x) in (list, tuple, set):
        out = type(x)(_copy(v, memo) for v in x)
    elif isinstance(x, dict):
        out = copy.copy(x)
        out.update({k: _copy(v, memo) for k, v in x.items()})
    elif hasattr(x, "__dict__") and type(x).__module__.startswith("transformers.cache_utils"):
        out = copy.copy(x)
        memo[id(x)] = out  # before its attributes: a layer may point back at its cache
        out.__dict__.update({k: _copy(v, memo) for k, v in vars(x).items()})
    memo[id(x)] = out
    return out
