"""The streams a sharded model's units run their copies and collectives on, and the events
between them. On CUDA they are real streams; on the CPU every call is a no-op, and the trace of
memfit._instrument (tests) records the calls so the ordering rules can be checked without a GPU.

The CUDA path is written for GPUs but cannot run on the CPU-only machine this package is
tested on: the CPU tests check the same sequence of waits and records through the trace.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from memfit._instrument import HOOKS

# [Note: Streams and buffer lifetimes]
# Three streams (four with replicas), as in FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):
# - "compute": the current stream; forward, backward, the copy-out of gathered parameters.
# - "gather": the copy-in of a unit's shards into its send buffer and the all-gather. It waits
#   for compute first (the optimizer step wrote the shards), so a prefetch overlaps the
#   compute of the unit before it. Compute waits for the all-gather's event before it copies
#   the gathered buffer out into the full parameters.
# - "reduce": the reduce-scatter, the division, and the addition into gradient shards that
#   exist already (FSDP2's post-reduce stream does the same). It waits for compute first (the
#   gradients were copied into the send buffer on compute, the old gradient shards written);
#   compute waits for its post-reduce event at the end of backward, so reduce-scatters overlap
#   the next units' backward, and at once only where it reads the reduce output itself (debug
#   checks). The copy-in runs on compute, as FSDP2's, so that autograd's full gradients are
#   freed at once on the stream that allocated them.
# - "all_reduce" (hybrid sharding only): the all-reduce of a reduced shard across the replicas
#   and, after it, the division and the addition into gradient shards (FSDP2's all-reduce
#   stream, its post-reduce stream under HSDP). It waits for the reduce-scatter's event and
#   for the compute event the reduce stream waited for; the reduce stream never waits for it
#   within a backward, so later units' reduce-scatters do not queue behind the inter-node
#   all-reduce. Compute waits for it at the end of backward.
# Traced buffers (memfit.testing.trace_streams): each unit's gather output, full gradients,
# send buffer, reduce output and gradient shards; host offload traces its copies the same way.
# A buffer allocated on one stream and used on another must not be freed (the caching
# allocator would hand its memory to the allocating stream at once) before the allocating
# stream has waited for an event recorded after the use. The holding rules, each as early as
# FSDP2's (tests/unit/test_stream_rules.py checks the trace):
# - an all-gather output, after its copy-out on compute: in forward it is held until the next
#   all-gather waits for the copy-out event (so the copy-out overlaps that all-gather, FSDP2's
#   implicit prefetch), at most one per root and none once the root's forward ends; in
#   backward it is freed at once, the gather stream waiting for the copy-out;
# - a unit's full gradients: freed right after the copy-in, on compute (no hold);
# - the send buffer (allocated on compute): until the next unit's post-backward, where compute
#   waits for the reduce-scatter that read it (with one rank it is the output the shards'
#   gradients view: until the end of backward);
# - the reduce output (allocated on the reduce stream): the gradient shards view it; compute
#   waits for the post-reduce event at the end of backward, before the optimizer reads them.
# No `record_stream`, no host waits. On the CPU the same buffers live as long, except that an
# all-gather output goes right after its copy-out in forward too; so the planner's sharded
# forecasts, measured on the CPU, follow the CUDA lifetimes ([Note: Sharded forecasts]).


# The compute stream is the stream current when the work is queued, looked up at each use
# (FSDP2 likewise reads `current_stream()` per call), not the one current when the root was
# set up: a step run under `torch.cuda.stream(s)` (a second model's step, CUDA graphs' capture
# stream, a framework's own stream) has its forward and backward on `s`, and the side streams
# must wait for `s`. Inside `on(side)` the current stream is the side stream, so a use of
# "compute" there means the stream current when `on` was entered (per thread: autograd runs
# backward on its own threads, with the forward ops' streams current).


class Streams:
    """The compute, gather, reduce and all-reduce streams of one root (CUDA), or no-ops (CPU).
    ``api``: the CUDA module (tests pass a stand-in with its stream and event calls)."""

    def __init__(self, device: torch.device, api=None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._entered = threading.local()  # .stack: the compute streams current at each `on`
        if self.cuda:
            self._api = torch.cuda if api is None else api
            high = self._api.Stream.priority_range()[1]  # collectives first, as FSDP2 does
            self._streams = {
                name: self._api.Stream(device, priority=high) for name in ("gather", "reduce", "all_reduce")
            }

    def _get(self, stream: str):
        """The CUDA stream named ``stream`` (See the compute stream's note above)."""
        if stream != "compute":
            return self._streams[stream]
        stack = getattr(self._entered, "stack", None)
        return stack[-1] if stack else self._api.current_stream(self.device)

    @contextlib.contextmanager
    def on(self, stream: str) -> Iterator[None]:
        """Run the enclosed ops (and allocate their outputs) on ``stream``."""
        if not self.cuda:
            yield
            return
        compute = self._get("compute")
        stack = self._entered.__dict__.setdefault("stack", [])
        stack.append(compute)
        try:
            with self._api.stream(compute if stream == "compute" else self._streams[stream]):
                yield
        finally:
            stack.pop()

    def record(self, stream: str):
        """An event marking the work queued on ``stream`` so far (a unique stand-in on the CPU)."""
        event: torch.cuda.Event | object
        if self.cuda:
            cuda_event = self._api.Event()
            cuda_event.record(self._get(stream))
            event = cuda_event
        else:
            event = object()  # a stand-in: unique, as a CUDA event is (one trace holds every root's)
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("record", stream, event))
        return event

    def wait(self, stream: str, event) -> None:
        """Make ``stream`` wait (on the device, not the host) for ``event``."""
        if event is None:
            return
        if self.cuda:
            self._get(stream).wait_event(event)
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("wait", stream, event))

    def after(self, waiter: str, recorder: str) -> None:
        """``waiter`` waits for everything queued on ``recorder`` so far."""
        self.wait(waiter, self.record(recorder))

    @property
    def holds(self) -> bool:
        """Whether buffers used across streams must be held until an event: on CUDA (and when
        traced, to check the order). On the CPU every op has finished when it returns."""
        return self.cuda or HOOKS.trace is not None

    def note(self, kind: str, buffer: str, stream: str) -> None:
        """Trace only: ``buffer`` was allocated, used or freed (``kind``) on ``stream``."""
        if HOOKS.trace is not None:
            HOOKS.trace.log.append((kind, buffer, stream))
