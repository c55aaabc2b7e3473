"""Whether this thread is recomputing a checkpointed block, or has checkpointing turned off:
read by activation checkpointing (memfit/_checkpoint/) and by sharding (memfit/_shard/: a unit
re-gathered in recompute), so it sits below both."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Local(threading.local):
    recompute_depth = 0
    disabled_depth = 0


_local = _Local()


def is_recomputing() -> bool:
    """True while memfit re-runs a checkpointed block during backward (in this thread)."""
    return _local.recompute_depth > 0


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Inside this context checkpointed functions and modules run plainly, keeping activations."""
    _local.disabled_depth += 1
    try:
        yield
    finally:
        _local.disabled_depth -= 1


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Around a checkpointed block's recompute: is_recomputing() is True inside."""
    _local.recompute_depth += 1
    try:
        yield
    finally:
        _local.recompute_depth -= 1


def checkpointing_disabled() -> bool:
    """True inside disable_checkpointing() (in this thread)."""
    return _local.disabled_depth > 0
