"""Where sharding's tensors live and how they cross between host and device: the compute
device a process group implies, host<->device copies, and reads of device values on the host.
Every such choice and transfer goes through here, so one place decides and one log audits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# [Note: Devices and the meta test device]
# A unit computes on one device: the accelerator of its process group's backend (NCCL: the
# current CUDA device, as FSDP2 and torchrun's LOCAL_RANK setup expect), the CPU for gloo, or
# what `device=` says. Its collectives run there, and so do broadcasts of initial values.
# With `offload="cpu"` the shards, their gradients and the optimizer state live in host
# memory: before an all-gather the unit's chunks are packed on the host into one pinned
# staging buffer and copied to the device in one non-blocking copy on the gather stream;
# after a reduce-scatter the reduced gradients come back in one non-blocking copy into pinned
# memory on the reduce stream, and the host waits for the last of those copies once, at the
# end of backward, before the optimizer (on the host) reads them (FSDP2 does the same; a gradient
# that accumulates into an existing one is added on the host after that one wait). Unlike FSDP2, which
# copies each pinned chunk to the device on its own (a launch per parameter), the chunks stay
# pageable and the host packs them (one memcpy, casting to the wire dtype) so that one copy
# crosses; keeping the chunks as views of one pinned buffer per unit would save that memcpy too.
# The host reads device values only through `host_read`, counted in `AUDIT`.
#
# Tests see device mistakes without a GPU through a pretend accelerator: the meta device with
# a process group backend that supports only it (memfit.testing.meta_accelerator). torch's own
# rules then refuse what CUDA and NCCL refuse: a CPU tensor in a collective fails with NCCL's
# "No backend type associated with device type cpu", an op mixing CPU and device tensors
# fails as on CUDA, and any host read of a device value fails ("Cannot copy out of meta
# tensor"), so a hidden host sync cannot pass. Meta tensors hold no values: `host_read`
# returns None for them and `to_host` returns an unfilled host tensor; values are checked by
# the gloo parity tests. Streams, pinned memory, copy overlap and allocator peaks need a real
# GPU (not run here).


@dataclass
class Audit:
    """What crossed between host and device (tests read it through memfit.testing)."""

    host_reads: int = 0  # device values read on the host (each one a host sync)
    to_device: list[tuple[int, bool, bool]] = field(default_factory=list)  # (bytes, pinned source, non_blocking)
    to_host: list[tuple[int, bool, bool]] = field(default_factory=list)  # (bytes, pinned target, non_blocking)
    host_waits: int = 0  # host waits for copies to the host (one per step at most)
    active: bool = False  # recording: only inside `audit()`, so that a long run keeps no log

    def reset(self) -> None:
        self.host_reads = self.host_waits = 0
        self.to_device.clear()
        self.to_host.clear()


AUDIT = Audit()  # process-wide: counts every crossing of the process (recording only inside audit())
# Events after copies to the host not waited for yet: one per copy (copies of several sharded
# roots may run on different streams, so the last event alone need not cover them all).
_pending_host_copies: list = []


def compute_device(group: dist.ProcessGroup) -> torch.device:
    """The device ``group``'s backend communicates on: the CPU for a backend that takes CPU
    tensors (gloo, which takes CUDA ones too), else its accelerator, on this process's current
    device (NCCL: CUDA), also when a host backend sits beside it ("cpu:gloo,cuda:nccl")."""
    types = [d.type for d in group._device_types]
    accelerators = [t for t in types if t != "cpu"]
    mixed = ":" in str(dist.get_backend(group))  # one backend per device type, named by type
    if not accelerators or ("cpu" in types and not mixed):
        return torch.device("cpu")
    kind = accelerators[0]
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def resolved(device: torch.device | str) -> torch.device:
    """``device`` (asked for with ``shard(device=)``) with its index: the current one of its kind
    when none is given, as :func:`compute_device` picks; refuses an accelerator this process lacks."""
    device = torch.device(device)
    module = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
    if module is None or not hasattr(module, "is_available"):
        return device
    if not module.is_available():
        raise ValueError(
            f"memfit.shard: device={str(device)!r}, but this process sees no {device.type} device; pass "
            "device='cpu' (or none: the process group's device)"
        )
    if device.index is None and hasattr(module, "current_device"):
        return torch.device(device.type, module.current_device())
    return device


def pinning() -> bool:
    """Whether host memory can be pinned (page-locked): only with an accelerator present."""
    return torch.accelerator.is_available()


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, pinned where an accelerator can copy from it asynchronously."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinning())


def to_device(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy host tensor ``src`` into device tensor ``dst``, without blocking the host when
    ``src`` is pinned (queued on the current stream)."""
    if AUDIT.active:
        pinned = src.is_pinned() if pinning() else False
        AUDIT.to_device.append((src.numel() * src.element_size(), pinned, True))
    dst.copy_(src, non_blocking=True)


def to_host(src: torch.Tensor, dtype: torch.dtype, stream_event=None) -> torch.Tensor:
    """``src`` in host memory as ``dtype``: one copy into pinned memory, non-blocking on the
    current stream; the host waits for it in :func:`wait_host_copies`. ``stream_event`` records
    an event after the copy (the caller's stream's ``record``)."""
    if src.device.type == "cpu":
        return src.to(dtype)  # computing on the CPU: nothing crosses
    if src.dtype != dtype:
        src = src.to(dtype)  # cast on the device, as FSDP2 does: the host only waits (a bf16 gradient crosses as fp32)
    dst = host_empty(src.shape, dtype)
    if AUDIT.active:
        AUDIT.to_host.append((dst.numel() * dst.element_size(), pinning(), True))
    if not src.is_meta:  # See [Note: Devices and the meta test device]
        dst.copy_(src, non_blocking=True)
    if stream_event is not None:
        _pending_host_copies.append(stream_event())
    return dst


def wait_host_copies() -> None:
    """Block the host until the copies to the host queued so far have landed (once per step;
    once the latest has landed, waiting for the earlier events costs nothing)."""
    if not _pending_host_copies:
        return
    events = _pending_host_copies[::-1]
    _pending_host_copies.clear()
    AUDIT.host_waits += AUDIT.active
    for event in events:
        if hasattr(event, "synchronize"):  # pragma: no cover (a CUDA event: needs a GPU)
            event.synchronize()


def host_read(t: torch.Tensor) -> Any:
    """The values of ``t`` on the host, as ``t.tolist()`` (a number for a 0-d tensor; a host
    sync when ``t`` is on a device); None for a tensor of the meta test device, which has none."""
    AUDIT.host_reads += AUDIT.active
    if t.is_meta:  # See [Note: Devices and the meta test device]
        return None
    return t.tolist()


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def moved(t: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """``t`` on ``device`` (a copy when ``copy`` or when it is elsewhere); outside the hot path
    (initialisation, loading). From the meta test device to the host: an unfilled tensor."""
    if same_device(t.device, device):
        return t.clone() if copy else t
    if t.is_meta:  # See [Note: Devices and the meta test device]
        return torch.empty_like(t, device=device)
    return t.to(device)


@contextlib.contextmanager
def audit() -> Iterator[Audit]:
    """Count the host/device traffic inside this context (tests)."""
    AUDIT.reset()
    AUDIT.active = True
    try:
        yield AUDIT
    finally:
        AUDIT.active = False


def copy_in(send: torch.Tensor, views_of, srcs: list[torch.Tensor]) -> None:
    """Fill the buffer ``send``: ``views_of(buffer)`` lists where each of ``srcs`` goes.
    Sources in host memory while ``send`` is on an accelerator (offloaded shards) are packed on
    the host into one pinned staging buffer laid out like ``send``, which crosses in one
    non-blocking copy; the rest are copied on the device (one launch each way, whatever the
    number of parameters). See [Note: Devices and the meta test device]."""
    views = views_of(send)
    host = [i for i, s in enumerate(srcs) if s.device.type == "cpu"]
    if send.device.type == "cpu" or not host:
        _foreach_copy_by_dtype(views, srcs)
        return
    staging = host_empty(send.shape, send.dtype)
    staged = views_of(staging)
    torch._foreach_copy_([staged[i] for i in host], [srcs[i] for i in host])
    to_device(staging, send)
    rest = [i for i in range(len(srcs)) if srcs[i].device.type != "cpu"]
    if rest:
        torch._foreach_copy_([views[i] for i in rest], [srcs[i] for i in rest])


def _foreach_copy_by_dtype(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])``, one ``_foreach_copy_`` per (destination, source) dtype pair:
    CUDA's fast path (one launch) needs one dtype per list, so a byte wire that carries bf16
    chunks beside fp32 norm chunks copies in two launches, not one per parameter."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        groups.setdefault((d.dtype, s.dtype), []).append(i)
    for idx in groups.values():
        torch._foreach_copy_([dsts[i] for i in idx], [srcs[i] for i in idx])


def land(out: torch.Tensor, like: torch.Tensor, record) -> torch.Tensor:
    """Reduced gradients ``out`` where and as the shard ``like`` keeps them: cast on the device,
    or, for shards in host memory, one non-blocking copy into pinned memory whose event
    (``record()``) the host waits for once, in :func:`wait_host_copies`."""
    if same_device(out.device, like.device):
        return out if out.dtype == like.dtype else out.to(like.dtype)
    return to_host(out, like.dtype, record)


def device_of_units(units) -> torch.device:
    """Where a sharded model computes: its full parameters' device (even when the shards are
    offloaded), else its process group's."""
    full = next((sp.full.device for u in units for sp in u.params), None)
    return full if full is not None else compute_device(units[0].group)


def fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` across devices, outside the hot path (initialisation, loading); a meta
    ``src`` has no values to give a host ``dst`` (See [Note: Devices and the meta test device])."""
    if src.is_meta and not dst.is_meta:
        return
    dst.copy_(src)
