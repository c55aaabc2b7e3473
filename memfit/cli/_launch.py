"""Process groups for the commands: torchrun's, a group of one, or N ranks spawned here.

The device follows ``--device`` (auto: CUDA when there is one) and the backend the device:
NCCL on the local GPU (``LOCAL_RANK``) for CUDA, gloo for the CPU. A group memfit starts meets
on 127.0.0.1 at a port the OS gave as free. ``MEMFIT_PG_TIMEOUT`` (seconds) bounds how long one
collective of `memfit train` may wait.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """Where this process computes and how its process group connects the ranks."""

    device: torch.device  # cuda:LOCAL_RANK or cpu
    backend: str  # "nccl" for CUDA, "gloo" for the CPU
    local_rank: int  # this process's index on its machine (torchrun's LOCAL_RANK)


def choose_device(
    requested: str = "auto",
    *,
    env: Mapping[str, str] | None = None,
    cuda_devices: int | None = None,
    where: str = "memfit",
) -> Placement:
    """The device and backend for ``--device requested`` ("auto", "cpu" or "cuda"): CUDA on
    GPU ``LOCAL_RANK`` with NCCL (GPU 0 when a process sees one GPU only, as under a scheduler
    that sets CUDA_VISIBLE_DEVICES per task), or the CPU with gloo; auto is CUDA when there is
    a GPU.

    ``env`` (default ``os.environ``) and ``cuda_devices`` (default: how many GPUs torch sees)
    can be given, for tests. Raises ValueError naming ``--device`` when it cannot be met.
    """
    env = os.environ if env is None else env
    if requested not in DEVICES:
        raise ValueError(f"{where}: unknown --device {requested!r}; choose from {', '.join(DEVICES)}")
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank = _local_rank(env, where)
    if requested == "cpu" or (requested == "auto" and cuda_devices == 0):
        return Placement(torch.device("cpu"), "gloo", local_rank)
    if cuda_devices == 0:
        raise ValueError(
            f"{where}: --device cuda, but this torch ({torch.__version__}) sees no CUDA device; "
            "pass --device cpu (or --device auto, which falls back to the CPU)"
        )
    if cuda_devices == 1:  # one visible GPU per process (a scheduler set CUDA_VISIBLE_DEVICES per task)
        return Placement(torch.device("cuda", 0), "nccl", local_rank)
    if local_rank >= cuda_devices:
        raise ValueError(
            f"{where}: --device {requested}: local rank {local_rank} has no GPU ({cuda_devices} CUDA "
            f"device(s) here); start at most {cuda_devices} rank(s) per machine, or pass --device cpu"
        )
    return Placement(torch.device("cuda", local_rank), "nccl", local_rank)


def _local_rank(env: Mapping[str, str], where: str) -> int:
    raw = env.get("LOCAL_RANK", "0")
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ValueError(
            f"{where}: LOCAL_RANK={raw!r} is not a rank (an integer >= 0, this process's index on its "
            "machine, as torchrun sets it); unset LOCAL_RANK or launch with torchrun"
        )
    return rank


def _join(placement: Placement, **kwargs) -> None:
    """Select the rank's GPU (before any CUDA work) and join the group with the device's backend."""
    if placement.device.type == "cuda":  # pragma: no cover (needs a GPU)
        torch.cuda.set_device(placement.device)
        kwargs["device_id"] = placement.device
    dist.init_process_group(placement.backend, **kwargs)


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS's pick), for a group to meet at."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pg_timeout(default: float = 600.0) -> datetime.timedelta:
    """``MEMFIT_PG_TIMEOUT`` seconds, else ``default``: how long one collective may wait."""
    return datetime.timedelta(seconds=float(os.environ.get("MEMFIT_PG_TIMEOUT", default)))


def init_process_group(
    timeout: datetime.timedelta | None = None, device: str = "cpu", where: str = "memfit"
) -> Placement:
    """Join torchrun's group (from its environment) or, run alone, form a group of one, on
    the device ``--device`` asks for (see :func:`choose_device`); returns that placement.

    Only selects the device when this process is already in a group.
    """
    placement = choose_device(device, where=where)
    if dist.is_initialized():
        if placement.device.type == "cuda":  # pragma: no cover (needs a GPU)
            torch.cuda.set_device(placement.device)
        return placement
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        _join(placement, **kwargs)
    else:
        _join(placement, init_method=f"tcp://{HOST}:{free_port()}", rank=0, world_size=1, **kwargs)
    return placement


def spawn(fn: Callable, world_size: int, *args, device: str = "cpu", where: str = "memfit"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each in one
    group meeting on 127.0.0.1 and with its share of the CPU cores; returns rank 0's value.
    ``device`` as ``--device``: rank r computes on GPU r with NCCL, or on the CPU with gloo
    (:func:`choose_device` with LOCAL_RANK=r; checked for the last rank before any starts).

    ``fn`` must be importable (a module-level function); what it returns must pickle.
    """
    choose_device(device, env={"LOCAL_RANK": str(world_size - 1)}, where=where)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _rank, args=(fn, world_size, free_port(), args, queue, device), nprocs=world_size, start_method="spawn"
    )
    return queue.get()


def _rank(rank: int, fn: Callable, world_size: int, port: int, args: tuple, queue, device: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    placement = choose_device(device, env={"LOCAL_RANK": str(rank)})
    _join(placement, init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()
    # The work is done and delivered: leave without the interpreter's teardown. In about 1 run in
    # 4 under pytest a finished rank aborted there ("terminate called without an active
    # exception", no Python frame left), which failed a run whose results were complete; the
    # cause (a C++ thread still joinable at exit) is not found yet.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def warn_world_size(world_size: int) -> None:
    """Warn when ``world_size`` ranks on this machine would share CPU cores."""
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(
            f"memfit: --world-size {world_size} is more than the {cores} CPU cores here; ranks will share cores",
            stacklevel=2,
        )
