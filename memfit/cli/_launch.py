"""Process groups for the commands: torchrun's, a group of one, or N ranks spawned here.

The device follows ``--device`` (auto: CUDA when there is one) and the backend the device:
NCCL on the local GPU (``LOCAL_RANK``) for CUDA, gloo for the CPU. A group memfit starts meets
on 127.0.0.1 at a port the OS gave as free. ``MEMFIT_PG_TIMEOUT`` (seconds) bounds how long one
collective of `memfit train` may wait. Under torchrun, each attempt meets under keys of its own
in the agent's store (see [Note: A fresh store for each torchrun attempt]).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

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
    spawned: int | None = None,
    where: str = "memfit",
) -> Placement:
    """The device and backend for ``--device requested`` ("auto", "cpu" or "cuda"): CUDA on
    GPU ``LOCAL_RANK`` with NCCL (GPU 0 when a process sees one GPU only, as under a scheduler
    that sets CUDA_VISIBLE_DEVICES per task), or the CPU with gloo; auto is CUDA when there is
    a GPU.

    ``env`` (default ``os.environ``) and ``cuda_devices`` (default: how many GPUs torch sees)
    can be given, for tests. ``spawned``: how many ranks memfit starts on this machine itself
    (:func:`spawn`), each of which needs a GPU of its own. Raises ValueError naming ``--device``
    when it cannot be met.
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
    if spawned is not None and spawned > cuda_devices:  # NCCL: "Duplicate GPU detected"
        raise ValueError(
            f"{where}: --device {requested}: {spawned} ranks on this machine but torch sees {cuda_devices} CUDA "
            f"device(s), and each rank needs a GPU of its own (NCCL refuses two ranks on one GPU); start at most "
            f"{cuda_devices} rank(s) (--world-size {cuda_devices}), or pass --device cpu"
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
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            wait = timeout or datetime.timedelta(minutes=10)
            agent = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=wait
            )
            kwargs.update(store=attempt_store(agent, rank, world_size, wait), rank=rank, world_size=world_size)
        _join(placement, **kwargs)
    else:
        _join(placement, init_method=f"tcp://{HOST}:{free_port()}", rank=0, world_size=1, **kwargs)
    return placement


# [Note: A fresh store for each torchrun attempt]
# torchrun's agent (c10d rendezvous, torch >= 2.4) hosts one TCPStore and hands it to every
# attempt of its workers: TORCHELASTIC_USE_AGENT_STORE=True, the same MASTER_PORT after each
# restart, and env:// adds no prefix per attempt. The keys a dead attempt wrote are still there
# when the restarted ranks meet, so a rank can read a dead peer's entry before the live peer
# overwrites it: gloo then connects to a dead address ("connectFullMesh failed ... Connection
# refused") until it times out, on every restart; NCCL reads a stale unique id
# (pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT cannot name the attempt: an agent whose
# own workers did not fail restarts them without counting, so two nodes can disagree on it.
# memfit's group therefore meets under a prefix rank 0 draws afresh (a random session), handed
# out through keys no earlier attempt can have written: rank r > 0 posts a random token under
# hello/r and waits for welcome/<token>; rank 0 answers each hello it sees (a stale one too,
# harmlessly: no live rank waits for that key) until every rank r has written
# joined/<session>/r. Both ends wait at most the process group's timeout, and say who was missing.


def attempt_store(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """``store`` under a prefix that the ``world_size`` ranks calling this agree on and that no
    earlier group on ``store`` used. See [Note: A fresh store for each torchrun attempt]."""
    meet = dist.PrefixStore("memfit/attempt/", store)
    if rank == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        session = uuid.uuid4().hex
        pending, answered = set(range(1, world_size)), dict[int, str]()
        while pending:
            for r in sorted(pending):
                if meet.check([f"joined/{session}/{r}"]):
                    pending.discard(r)
                elif meet.check([f"hello/{r}"]):
                    token = meet.get(f"hello/{r}").decode()
                    if answered.get(r) != token:
                        meet.set(f"welcome/{token}", session)
                        answered[r] = token
            if pending and time.monotonic() > deadline:
                missing = ", ".join(map(str, sorted(pending)))
                raise RuntimeError(
                    f"memfit: rank 0: rank(s) {missing} of {world_size} did not join this attempt's process "
                    f"group within {timeout.total_seconds():g} s; check that every rank started (torchrun "
                    "--nnodes, the other nodes' logs), or raise MEMFIT_PG_TIMEOUT"
                )
            if pending:
                time.sleep(0.01)
    else:
        token = uuid.uuid4().hex
        meet.set(f"hello/{rank}", token)
        try:
            meet.wait([f"welcome/{token}"], timeout)
        except dist.DistStoreError as e:
            raise RuntimeError(
                f"memfit: rank {rank}: rank 0 did not answer within {timeout.total_seconds():g} s when this "
                f"attempt's process group met at the torchrun agent's store; check rank 0's log, or raise "
                "MEMFIT_PG_TIMEOUT"
            ) from e
        session = meet.get(f"welcome/{token}").decode()
        meet.set(f"joined/{session}/{rank}", "")
    return dist.PrefixStore(f"memfit/{session}/", store)


def spawn(fn: Callable, world_size: int, *args, device: str = "cpu", where: str = "memfit"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each in one
    group meeting on 127.0.0.1 and with its share of the CPU cores; returns rank 0's value.
    ``device`` as ``--device``: rank r computes on GPU r with NCCL, or on the CPU with gloo
    (:func:`choose_device` with LOCAL_RANK=r; checked for the last rank before any starts).

    ``fn`` must be importable (a module-level function); what it returns must pickle.
    """
    choose_device(device, env={"LOCAL_RANK": str(world_size - 1)}, spawned=world_size, where=where)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _rank, args=(fn, world_size, free_port(), args, queue, device), nprocs=world_size, start_method="spawn"
    )
    return queue.get()


def _rank(rank: int, fn: Callable, world_size: int, port: int, args: tuple, queue, device: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    placement = choose_device(device, env={"LOCAL_RANK": str(rank)}, spawned=world_size)
    _join(placement, init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(out)
        del out
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # the traceback holds the models: a failed rank leaves as it can
        raise
    if end_process_group():  # torch holds a group memfit could not free (torch FSDP2 does)
        leave_now()


# [Note: Ending a process group]
# gloo runs each collective on a worker thread of its ProcessGroup. The worker wakes whoever
# waits for the collective, then drops its own reference to the finished work, and with it the
# work's tensors, at a time of its choosing. A tensor whose Python object died in between is
# freed by that worker, which takes the GIL to free the Python object too. If the interpreter
# is already finalizing, CPython ends a thread that asks for the GIL with pthread_exit, whose
# forced unwinding through a C++ destructor (noexcept) calls std::terminate: "terminate called
# without an active exception", with no Python frame (gdb: ~AsyncWork -> TensorImpl::
# decref_pyobject -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread; torch issues
# #190489, #38228). It takes a worker that lags behind the main thread, so it came and went
# with the machine's load. The worker threads are joined when the ProcessGroup object is
# freed, while the interpreter can still take their GIL requests; destroy_process_group() only
# drops torch's own references to it, so anything else holding the group (a module-level
# cache, a model whose hooks form a reference cycle not yet collected, a DDP reducer) keeps the
# threads running into the teardown. A sharded model that had run a forward was such a holder,
# for ever: its parameters' post-accumulate-grad hook held the root's state, a cycle through
# C++ that the collector cannot free (the hook now holds it weakly; a step in flight holds it from
# its forward to the end of its backward in memfit/_shard/_runtime.py's _IN_FLIGHT, so the graph's
# own hooks hold it weakly too and a kept loss does not keep the model). `end_process_group`
# collects cycles first, destroys the groups, and names those that survive; memfit caches
# groups only weakly, and a sharded model is freed like any other. Where a group survives all
# the same (torch FSDP2's fully_shard keeps the default group alive, by a reference Python's
# collector does not see), a spawned rank leaves with `leave_now`: exit handlers run, output is
# flushed, and only the interpreter's teardown, where the abort happens, is skipped. A script
# that leaves its group to the teardown (an HF Trainer script ends after `save_model`, while
# the last collective's worker may still be freeing its tensors) gets `end_process_group_at_exit`
# from MemfitTrainer: `end_process_group` as an exit handler on a gloo group, as Lightning's
# launcher registers destroy_process_group; it ends the group while the interpreter lives, or
# at least after collecting garbage, which outlasts a lagging worker.


def end_process_group() -> list[str]:
    """Destroy every process group now (the default group and those made from it), after
    collecting reference cycles, so that gloo's worker threads end while the interpreter is
    alive; returns a description of each group that something still holds (their threads
    live on), empty when all were freed. See [Note: Ending a process group]."""
    if not dist.is_initialized():
        return []
    from memfit._shard import _runtime

    _runtime._IN_FLIGHT.clear()  # steps never finished: a forward whose backward never ran
    gc.collect()  # models with hooks are reference cycles, and hold their groups
    c10d = dist.distributed_c10d  # torch's registry of this process's groups (no public listing)
    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or [dist.group.WORLD])
    refs = [(weakref.ref(g), _describe(g)) for g in groups]
    del groups
    dist.destroy_process_group()
    gc.collect()
    return [what for ref, what in refs if ref() is not None]


@functools.cache  # registered once per process
def end_process_group_at_exit() -> None:
    """Run :func:`end_process_group` when the interpreter exits, if the default group is
    gloo's (the teardown race is gloo's; an NCCL rank that died must not wait on its peers to
    shut its communicators down), before the exit handlers registered earlier (one of those
    that destroys the group finds it gone): for scripts that leave their process group to the
    interpreter's teardown. See [Note: Ending a process group]."""
    atexit.register(_end_gloo_group)


def _end_gloo_group() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        end_process_group()


def leave_now(status: int = 0) -> NoReturn:
    """End this process as a normal exit would (non-daemon threads joined, exit handlers,
    flushed standard streams) but without the interpreter's teardown: for a process whose
    process group something still holds, so that gloo's threads outlive the interpreter (see
    [Note: Ending a process group]). Files left open are not flushed: close them first."""
    shutdown = getattr(threading, "_shutdown", None)  # what a normal exit runs before the handlers
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _describe(group: dist.ProcessGroup) -> str:
    ranks = dist.get_process_group_ranks(group)
    return "the default process group" if group is dist.group.WORLD else f"the process group of ranks {ranks}"


def warn_world_size(world_size: int) -> None:
    """Warn when ``world_size`` ranks on this machine would share CPU cores."""
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(
            f"memfit: --world-size {world_size} is more than the {cores} CPU cores here; ranks will share cores",
            stacklevel=2,
        )


def relaunched(command: str, env: Mapping[str, str] | None = None) -> str:
    """``command`` (a ``memfit ...`` line) as this process was launched: under torchrun, with
    torchrun's process counts in front (``torchrun --nproc-per-node 2 -m memfit train ...``), so
    that a line printed to run again is the job's, not one process's."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env or not command.startswith("memfit"):
        return command
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    launcher = f"torchrun {f'--nnodes {nodes} ' * (nodes > 1)}--nproc-per-node {env['LOCAL_WORLD_SIZE']} -m memfit"
    rendezvous = " (with this job's rendezvous flags)" if nodes > 1 else ""
    return launcher + command.removeprefix("memfit") + rendezvous
