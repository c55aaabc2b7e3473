"""Where saved tensors wait for backward: in place, or in host memory.

# [Note: Offload of saved tensors]
# Offload applies saved-tensor hooks around the tensors a checkpointed block keeps (its
# inputs). "cpu" copies accelerator tensors to pinned host memory in forward and copies them
# back in backward; tensors already on the CPU are kept as they are, so on a CPU-only machine
# "cpu" offload does no work at all. The copy path needs an accelerator and is not exercised
# by the CPU test suite.
"""

from __future__ import annotations

import contextlib

import torch

OFFLOAD_CHOICES = (None, "cpu")


def _pack_cpu(t: torch.Tensor):
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return (t.device, host)


def _unpack_cpu(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offload_hooks(offload: str | None) -> contextlib.AbstractContextManager:
    """A context under which saved tensors go to the `offload` target ("cpu" or None)."""
    if offload is None:
        return contextlib.nullcontext()
    if offload == "cpu":
        return torch.autograd.graph.saved_tensors_hooks(_pack_cpu, _unpack_cpu)
    raise ValueError(f"memfit: unknown offload target {offload!r}; choose one of {OFFLOAD_CHOICES}")
