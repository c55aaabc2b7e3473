"""Process groups for the commands: torchrun's, a group of one, or N ranks spawned here.

Every group is gloo and, when memfit starts it, meets on 127.0.0.1 at a port the OS gave as
free. ``MEMFIT_PG_TIMEOUT`` (seconds) bounds how long one collective of `memfit train` may wait.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS's pick), for a group to meet at."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pg_timeout(default: float = 600.0) -> datetime.timedelta:
    """``MEMFIT_PG_TIMEOUT`` seconds, else ``default``: how long one collective may wait."""
    return datetime.timedelta(seconds=float(os.environ.get("MEMFIT_PG_TIMEOUT", default)))


def init_process_group(timeout: datetime.timedelta | None = None) -> None:
    """Join torchrun's gloo group (from its environment) or, run alone, form a group of one.

    Does nothing when this process is already in a group.
    """
    if dist.is_initialized():
        return
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo", **kwargs)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{free_port()}", rank=0, world_size=1, **kwargs)


def spawn(fn: Callable, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each in one gloo
    group meeting on 127.0.0.1 and with its share of the CPU cores; returns rank 0's value.

    ``fn`` must be importable (a module-level function); what it returns must pickle.
    """
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(fn, world_size, free_port(), args, queue), nprocs=world_size, start_method="spawn")
    return queue.get()


def _rank(rank: int, fn: Callable, world_size: int, port: int, args: tuple, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def warn_world_size(world_size: int) -> None:
    """Warn when ``world_size`` ranks on this machine would share CPU cores."""
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(
            f"memfit: --world-size {world_size} is more than the {cores} CPU cores here; ranks will share cores",
            stacklevel=2,
        )
