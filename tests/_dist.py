"""Run a function on W spawned gloo ranks meeting on 127.0.0.1.

`run_ranks(fn, world_size, *args)` starts one process per rank, initialises a gloo process
group on a free port, calls ``fn(rank, world_size, *args)`` and returns the per-rank results.
A rank that raises makes the call fail with that rank's traceback; ranks still running after
``timeout`` seconds are killed and named; ``pg_timeout`` is the process group's own timeout
for one collective. ``fn`` must be importable (a module-level function).

`run_subtests(cases, world_size, *args)` runs many named sub-cases, ``case(rank, world_size,
*args)``, in one process group (process start-up is the cost on a small machine) and returns
{name: failure or None}, a failure naming every rank it happened on.

`MEMFIT_TEST_DEVICE=cuda` runs the ranks of the modules that opt in (`Subtests(...,
on_test_device=True)`) on CUDA with NCCL, rank r on GPU r (a world size larger than the GPU
count is skipped); their cases put models and inputs on `test_device()`. Every other module,
and every module by default, runs on the CPU with gloo.

`Subtests(cases)` is how a test module uses it: one spawned group per world size (and args)
runs every case once, and each pytest test reports one case from that run:

    GROUP = Subtests(CASES)

    @pytest.mark.parametrize("world", [1, 2])
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_feature(world, case):
        GROUP.check(case, world)
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from memfit.testing import free_port


def test_device() -> torch.device:
    """Where the suite's sharding cases compute: ``MEMFIT_TEST_DEVICE`` (``cpu``, the default,
    with gloo; ``cuda`` with NCCL, this process's current GPU)."""
    kind = os.environ.get("MEMFIT_TEST_DEVICE", "cpu")
    if kind == "cpu" or (dist.is_initialized() and dist.get_backend() != "nccl"):
        return torch.device("cpu")  # the default, and a module that runs on gloo
    if kind != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"MEMFIT_TEST_DEVICE={kind!r}: use cpu, or cuda on a machine with a GPU")
    return torch.device("cuda", torch.cuda.current_device())


test_device.__test__ = False  # a helper, not a test, where a test module imports it


def _worker(
    fn: Callable, rank: int, world_size: int, port: int, args: tuple, results, pg_timeout: float, cuda: bool
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, None, out))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 300.0,
    pg_timeout: float = 60.0,
    on_test_device: bool = False,
) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    cuda = on_test_device and os.environ.get("MEMFIT_TEST_DEVICE", "cpu") == "cuda"
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, pg_timeout, cuda), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world_size:
            try:
                rank, err, out = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    stuck = [r for r in range(world_size) if r not in outs]
                    raise AssertionError(f"ranks {stuck} did not finish within {timeout:.0f}s (killed)") from None
                continue
            if err is not None:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{err}")
            outs[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(world_size)]


# (world size, case name) -> seconds on rank 0, barrier included: pytest --durations sees one
# spawned group as its first test, so conftest prints the slowest sub-cases from here.
CASE_SECONDS: dict[tuple[int, str], float] = {}


def _run_cases(rank: int, world_size: int, cases: list[Callable], args: tuple) -> dict[str, str | None]:
    report: dict[str, str | None] = {}
    seconds: dict[str, float] = {}
    for case in cases:
        start = time.perf_counter()
        try:
            case(rank, world_size, *args)
            report[case.__name__] = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # pytest.fail and pytest.raises' "did not raise" are BaseExceptions
            report[case.__name__] = traceback.format_exc()
        dist.barrier()
        seconds[case.__name__] = time.perf_counter() - start
    return {"report": report, "seconds": seconds}


def run_subtests(
    cases: list[Callable], world_size: int, *args, timeout: float = 300.0, on_test_device: bool = False
) -> dict[str, str | None]:
    """Run ``case(rank, world_size, *args)`` for each case in one group; {case name: failure or None}."""
    outs = run_ranks(_run_cases, world_size, cases, args, timeout=timeout, on_test_device=on_test_device)
    reports = [out["report"] for out in outs]
    for name, s in outs[0]["seconds"].items():
        CASE_SECONDS[(world_size, name)] = CASE_SECONDS.get((world_size, name), 0.0) + s
    merged: dict[str, str | None] = {}
    for case in cases:
        errors = [f"rank {r}:\n{rep[case.__name__]}" for r, rep in enumerate(reports) if rep[case.__name__]]
        merged[case.__name__] = "\n".join(errors) or None
    return merged


def case_id(case: Callable) -> str:
    """A case's name without its ``case_`` prefix: the pytest id of its test."""
    return case.__name__.removeprefix("case_")


class Subtests:
    """``cases`` run in one spawned group per (world size, args), the first time a test asks."""

    def __init__(self, cases: list[Callable], timeout: float = 300.0, on_test_device: bool = False) -> None:
        self.cases = cases
        self.timeout = timeout
        self.on_test_device = on_test_device  # MEMFIT_TEST_DEVICE=cuda runs these cases on NCCL
        self._reports: dict[tuple, dict[str, str | None] | str] = {}  # a str: the group failed as a whole

    def report(self, world_size: int, *args) -> dict[str, str | None] | str:
        """{case name: failure or None} of the group's run (run now if it has not run yet), or
        what made the whole group fail (a rank died or hung)."""
        key = (world_size, *args)
        cuda = self.on_test_device and test_device().type == "cuda"
        if cuda and world_size > torch.cuda.device_count():
            pytest.skip(f"MEMFIT_TEST_DEVICE=cuda: {world_size} ranks need {world_size} GPUs")
        if key not in self._reports:
            try:
                self._reports[key] = run_subtests(
                    self.cases, world_size, *args, timeout=self.timeout, on_test_device=self.on_test_device
                )
            except AssertionError as e:
                self._reports[key] = f"the group of {world_size} ranks failed as a whole: {e}"
        return self._reports[key]

    def check(self, case: Callable, world_size: int, *args) -> None:
        """Fail the calling test if ``case`` failed on any rank of its group (or the group did)."""
        report = self.report(world_size, *args)
        failure = report if isinstance(report, str) else report[case.__name__]
        if failure:
            pytest.fail(failure, pytrace=False)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 400, env: dict | None = None):
    """Run ``script args`` under ``torchrun --standalone`` on ``nproc`` local ranks with this
    checkout first on PYTHONPATH; returns the CompletedProcess (text output captured)."""
    import subprocess
    import sys
    from pathlib import Path

    import memfit

    exe = str(Path(sys.executable).parent / "torchrun")
    repo = str(Path(memfit.__file__).parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [exe, "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=repo)
