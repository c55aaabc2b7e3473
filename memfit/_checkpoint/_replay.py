"""Global state a recompute must see exactly as the forward saw it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes

# [Note: What recompute replays]
# A checkpointed block runs twice: once in forward, once in backward. For the second run to
# produce bitwise the same tensors it must see the same
#   - random number generator state, on the CPU and on every accelerator its inputs live on
#     (dropout masks); the global generators are restored afterwards so recompute does not
#     shift the random stream of the rest of the program;
#   - autocast state (enabled, dtype, weight cache) of the CPU and of the inputs' device;
# and it must not update module state a second time: norm layers with running statistics
# (BatchNorm, InstanceNorm with track_running_stats) update their buffers in training mode,
# so their buffers are snapshotted before each call during recompute and restored after.
# The snapshot and the restore run outside every dispatch mode: they are not the block's work,
# and torch's selective-checkpoint mode would take the clone for an op missing from its cache.
# They need process-wide module hooks while the recompute runs, which put every module call of
# the recompute on nn.Module's slow path (a share of a small block's host time). They are set
# for every block: a block's forward may call a norm layer that is not its submodule.
# An autocast context whose state is the one already in force (CPU autocast off in forward
# and off in backward, the usual case) is not entered: entering it would change nothing.


def _device_module(device_type: str):
    return torch.get_device_module(device_type)


class Replay:
    """RNG and autocast state captured at the start of a checkpointed forward."""

    __slots__ = ("autocast", "cpu_rng", "device_rng")

    def __init__(self, tensors: Sequence[torch.Tensor], preserve_rng_state: bool) -> None:
        device_types = {"cpu"}
        devices: list[torch.device] = []
        for t in tensors:
            if t.device.type not in ("cpu", "meta") and t.device not in devices:
                devices.append(t.device)
                device_types.add(t.device.type)
        # Only accelerators already initialised: capturing state must not create a context.
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.device_rng: list[tuple[torch.device, torch.Tensor]] = []
        if preserve_rng_state:
            for d in devices:
                mod = _device_module(d.type)
                if getattr(mod, "is_initialized", lambda: True)():
                    self.device_rng.append((d, mod.get_rng_state(d.index)))
        self.autocast = [
            (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in sorted(device_types)
            if torch.amp.is_autocast_available(dt)
        ]

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Run the body under the captured state; restore the surrounding state after."""
        saved_cpu = torch.get_rng_state() if self.cpu_rng is not None else None
        saved_dev = [(d, _device_module(d.type).get_rng_state(d.index)) for d, _ in self.device_rng]
        try:
            if self.cpu_rng is not None:
                torch.set_rng_state(self.cpu_rng)
            for d, state in self.device_rng:
                _device_module(d.type).set_rng_state(state, d.index)
            cache = torch.is_autocast_cache_enabled()
            with contextlib.ExitStack() as stack:
                for dt, enabled, dtype in self.autocast:
                    if enabled or torch.is_autocast_enabled(dt):
                        stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=cache))
                stack.enter_context(_frozen_running_stats())
                yield
        finally:
            if saved_cpu is not None:
                torch.set_rng_state(saved_cpu)
            for d, state in saved_dev:
                _device_module(d.type).set_rng_state(state, d.index)


@contextlib.contextmanager
def _frozen_running_stats() -> Iterator[None]:
    """Norm layers called inside the body leave their running statistics unchanged."""
    stash: list[tuple[nn.Module, list[torch.Tensor]]] = []

    def pre(module: nn.Module, args) -> None:
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            with _disable_current_modes():
                stash.append((module, [b.clone() for b in module.buffers(recurse=False)]))

    def post(module: nn.Module, args, output) -> None:
        if stash and stash[-1][0] is module:
            _restore(*stash.pop())

    h_pre = nn.modules.module.register_module_forward_pre_hook(pre)
    h_post = nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h_pre.remove()
        h_post.remove()
        # Recompute may stop early, inside a norm layer's forward: restore what is left.
        while stash:
            _restore(*stash.pop())


def _restore(module: nn.Module, snapshot: list[torch.Tensor]) -> None:
    with torch.no_grad(), _disable_current_modes():
        for buf, old in zip(module.buffers(recurse=False), snapshot):
            buf.copy_(old)
