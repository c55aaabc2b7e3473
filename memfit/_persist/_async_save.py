"""Asynchronous checkpoints: stage to host memory, write in the background, one at a time."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["SAVES", "SaveFuture", "Saves"]

# [Note: Asynchronous checkpoints]
# `save_checkpoint(..., async_=True)` stalls training only for the copy of this rank's state
# into host memory (the "staging"); the write, the checksums and the atomic swap run on a
# background thread, and the call returns a `concurrent.futures.Future` whose `result()`
# waits for them and raises what went wrong.
# - Staging copies every tensor of the state: the parameters and optimizer state change at
#   the next step, the staged copy does not. On an accelerator the copies go to pinned
#   buffers without blocking, then one synchronisation of the device ends the staging (the
#   save's one host sync); the buffers are kept and reused by the next save of the same
#   tensors, so pinning is paid once. On the CPU staging is a memory copy.
# - The background thread's collectives (DCP's plan exchange, the checksums, the result of the
#   swap) run on a gloo group of their own, created on the first asynchronous save (every
#   rank of the model's group calls save_checkpoint, so every rank creates it, in the same
#   order), so they never interleave with the training's collectives on the model's group, as
#   torchtitan does. Gloo moves only these small objects; the data go to files.
# - At most one save is in flight in a process: a save of either kind, and load_checkpoint,
#   first wait for the previous one, and raise its error if it failed and nobody has asked the
#   future for it (`result()` or `exception()`), so a failed background write is never lost
#   silently. Wait for the last one (`result()`) before
#   `destroy_process_group`; at exit Python waits for the thread.
# - What survives a kill or a failure is what survives a synchronous save: the write goes to
#   a temporary directory swapped in only when whole (See [Note: Atomic directory
#   replacement]); until then the previous checkpoint is the newest whole one.
# Only the staging's device path (pinned buffers, non-blocking copies) needs an accelerator to
# run; everything else is tested on the CPU.


class SaveFuture(concurrent.futures.Future):
    """A save's future that knows whether its outcome was read (then the next save does not
    raise its error again)."""

    seen = False

    def result(self, timeout=None):
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.seen = True
        return super().exception(timeout)


class Saves:
    """The save in flight in this process, the staging buffers and the writers' groups."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: SaveFuture | None = None
        self._path = ""
        self._groups: dict[tuple[int, ...], Any] = {}  # model group's ranks -> the writer's gloo group
        self._buffers: dict[str, torch.Tensor] = {}  # state key -> host buffer of the last staging

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error if it failed."""
        future, self._future = self._future, None
        if future is None:
            return
        seen = future.seen
        try:
            future.result()
        except BaseException as e:
            if seen:
                return
            raise RuntimeError(
                f"memfit.save_checkpoint: the asynchronous save to {self._path!r} failed: {e}; "
                "the checkpoint there before it is untouched"
            ) from e

    def writer_group(self, group) -> Any:
        """A gloo group over ``group``'s ranks, for the background thread's collectives."""
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), backend="gloo")
        return self._groups[ranks]

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in host memory: tensors copied into reused (pinned) buffers."""
        out: dict[str, Any] = {}
        devices = set()
        for key, v in state.items():
            if isinstance(v, DTensor):
                local = self._copy(key, v.to_local())
                out[key] = DTensor.from_local(
                    local, v.device_mesh, v.placements, shape=v.shape, stride=v.stride(), run_check=False
                )
                devices.add(v.to_local().device)
            elif torch.is_tensor(v):
                out[key] = self._copy(key, v)
                devices.add(v.device)
            else:
                out[key] = v
        for device in devices - {torch.device("cpu")}:  # pragma: no cover (needs an accelerator)
            torch.get_device_module(device.type).synchronize(device)
        for key in set(self._buffers) - set(state):
            del self._buffers[key]
        return out

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.stride() != t.stride():
            pin = t.device.type != "cpu"
            buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf.copy_(t.detach(), non_blocking=True)

    def submit(self, path: str, write: Callable[[], None]) -> SaveFuture:
        """Run ``write`` on the background thread; the caller waited for the last save already."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memfit-save")
        future = SaveFuture()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                write()
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(None)

        self._path, self._future = path, future
        self._executor.submit(run)
        return future


SAVES = Saves()  # process-wide: at most one save in flight per process, whatever the model
