"""`memfit calibrate`: this machine's rates for the time model, measured once and cached (see
[Note: The planner's time model] and [Note: Calibrating on cold data])."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit._plan._time import (
    CUDA_WORKSPACE,
    PROFILES,
    CostRecorder,
    DeviceProfile,
    default_profile,
    named_profile,
    op_cost,
)


class _AttentionCalls(TorchDispatchMode):
    """The attention ops run inside it, with their arguments (to time them again)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost.scores:
            self.calls.append((func, args, kwargs, cost))
        return out


def _best_seconds(fn, repeats: int = 5, clock=time.perf_counter) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up: another process on the machine
    (or its cache misses and page faults) only ever adds time to a run (calibrate_group's
    ranks time in windows instead: see _windowed)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


_WINDOW = 0.02  # seconds: longer than a scheduler's time slice (a few ms), shorter than a step


def _windowed(fn, repeats: int, clock) -> float:
    """Seconds per call of ``fn``, the median of ``repeats`` timings of as many calls as take
    ``_WINDOW`` at least (after one warm-up call): where ranks outnumber the cores a call of
    a few us to ms mostly runs while the others wait, and a step's ops do not. See
    [Note: Calibrating the links]."""
    t0 = clock()
    fn()
    calls = max(1, math.ceil(_WINDOW / max(clock() - t0, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - t0) / calls)
    return statistics.median(times)


# [Note: Calibrating on cold data]
# In a training step an op reads what other ops wrote well before (the step's tensors, tens of
# MiB and more, do not stay in the caches), and the step's elementwise ops ran at the rate of
# data from memory: on a 2-core AMD EPYC (32 MiB L3) the mul, div, add and lerp_ ops of a Llama
# step streamed 36-54 GB/s, where a copy repeated on one 128 KiB tensor streams 118 GB/s
# from the cache; small matmuls on operands from memory ran 86-96 GFLOP/s against 101-104 on
# operands in cache. So calibration times each op over a pool of distinct operands (64 MiB in
# all, twice that CPU's last-level cache; at most 1024 of them), visited in turn, so that each
# call meets its data out of cache (a CPU with a larger cache keeps part of it warm).
_POOL = 64 * 2**20


def _cold(make, op, timed, pool_bytes: int = _POOL) -> float:
    """Seconds per call of ``op`` over a pool of operand tuples from ``make()``, each visited
    once per pass (see [Note: Calibrating on cold data])."""
    first = make()
    nbytes = sum(t.nbytes for t in first)
    pool = [first] + [make() for _ in range(min(1024, max(2, pool_bytes // nbytes)) - 1)]

    def sweep():
        for args in pool:
            op(*args)

    return timed(sweep, 3) / len(pool)


def _fit(work: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares of seconds = work / rate + constant: (rate, constant >= 0)."""
    n, mx, my = len(work), statistics.fmean(work), statistics.fmean(seconds)
    slope = sum((x - mx) * (y - my) for x, y in zip(work, seconds)) / sum((x - mx) ** 2 for x in work)
    slope = max(slope, 1e-30)
    return 1 / slope, max(0.0, my - slope * mx) if n > 1 else 0.0


def cache_path(device_type: str) -> Path:
    root = os.environ.get("MEMFIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memfit"
    )
    return Path(root) / f"device-{device_type}.json"


def calibrate(
    device: str | torch.device = "cpu", *, save: bool = True, cpu_time: bool = False, typical: bool = False
) -> DeviceProfile:
    """Measure this machine's rates (a few seconds) and cache them for ``device``'s type: the
    matmul rate and latency per dtype and the memory bandwidth, each fitted over several sizes
    on data out of cache, the element rates of arithmetic-bound ops, the attention kernels'
    score rates, the cost per op of a tiny model's training step and what checkpointing its
    blocks adds, and the offload path (disk for a CPU, host memory for an accelerator).
    ``cpu_time``: time with the process's CPU time (``time.process_time``), not the wall clock:
    on a loaded CPU with one thread the work is counted without the time other processes hold
    the cores. ``typical``: the median of each op's repeats, not the fastest (calibrate_group:
    ranks sharing the machine, the fastest repeat is one the others left it alone)."""
    device = torch.device(device)
    sync = getattr(torch.get_device_module(device.type), "synchronize", None) if device.type != "cpu" else None
    clock = time.process_time if cpu_time else time.perf_counter

    def timed(fn, repeats=5):
        def run():
            fn()
            if sync:
                sync()

        if typical:  # see [Note: Calibrating the links]: each timing as long as a step's slice of it
            return _windowed(run, repeats, clock)
        return _best_seconds(run, repeats, clock)

    # See [Note: Calibrating on cold data].
    flops, latency = {}, 0.0
    for dtype in (torch.float32, torch.bfloat16):
        rate, c = _matmul_rate(device, dtype, timed)
        flops[str(dtype).removeprefix("torch.")] = rate
        latency = c if dtype is torch.float32 else latency
    # Written first: pages never touched read as one shared zero page, far faster than memory.
    numels = [2**k // 4 for k in (16, 18, 20, 22, 24, 26)]  # 64 KiB .. 64 MiB
    pair = lambda n: (torch.ones(n, device=device), torch.zeros(n, device=device))  # noqa: E731
    seconds = [_cold(lambda n=n: pair(n), lambda a, o: torch.mul(a, 2.0, out=o), timed) for n in numels]
    moved = [8.0 * n for n in numels]  # read and written
    memory_bandwidth, op_cost_constant = _fit(moved, seconds)
    curve = tuple((m, m / max(t - op_cost_constant, t / 2)) for m, t in zip(moved, seconds))
    big = pair(numels[-1])[0]
    overheads = _op_overhead(device, timed)
    profile = DeviceProfile(
        f"calibrated-{device.type}",
        flops,
        memory_bandwidth,
        _offload_bandwidth(device, big, timed),
        overheads["op_overhead"],
        f"measured by memfit calibrate on {os.uname().nodename} at {time.strftime('%Y-%m-%d %H:%M')}",
        matmul_latency=latency,
        bandwidth_curve=curve,
        math_rates=_math_rates(device, timed),
        score_rates=_score_rates(device, timed, flops["float32"]),
        checkpoint_block=overheads["checkpoint_block"],
        checkpoint_op=overheads["checkpoint_op"],
        **(_fresh_pages(timed) if device.type == "cpu" else {}),
        workspace_bytes=CUDA_WORKSPACE if device.type == "cuda" else 0,  # not measured: the H100's
        calibrated_ranks=1,
    )
    if save:
        save_profile(profile, device.type)
    return profile


def save_profile(profile: DeviceProfile, device_type: str) -> Path:
    """Cache ``profile`` as this machine's calibration of ``device_type``; returns where."""
    path = cache_path(device_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    return path


def _matmul_rate(device: torch.device, dtype: torch.dtype, timed) -> tuple[float, float]:
    """The matmul rate and latency fitted over the three products of a Linear layer's training
    step (forward x @ W.t(), backward g @ W and g.t() @ x) at the shapes of a transformer's
    layers of width n: in -> out of n -> 4n, 4n -> n and n -> 32n (an LM head: vocabularies
    are 8-64x the width), on 2n tokens, for two widths (64 and 256 on a CPU, 16x on an
    accelerator). Square matmuls run faster than these: the products with a small inner or
    outer dimension and the transposed operands of backward ran 82-94 GFLOP/s here where
    squares of 512 ran 98. The latency: on a CPU the smaller width's products' excess
    (:func:`_matmul_fit`); on an accelerator, where those take hundreds of us, a 64 x 64
    product's time (not yet measured on one)."""
    widths = (64, 256) if device.type == "cpu" else (1024, 4096)
    products = {
        "forward": lambda x, w, g, y, gx, gw: torch.mm(x, w.t(), out=y),
        "grad_input": lambda x, w, g, y, gx, gw: torch.mm(g, w, out=gx),
        "grad_weight": lambda x, w, g, y, gx, gw: torch.mm(g.t(), x, out=gw),
    }
    work, seconds = [], []
    for n in widths:
        for fan_in, fan_out in ((n, 4 * n), (4 * n, n), (n, 32 * n)):

            def make(t=2 * n, i=fan_in, o=fan_out):  # values do not change a matmul's speed
                full = lambda *shape: torch.full(shape, 0.5, device=device, dtype=dtype)  # noqa: E731
                return full(t, i), full(o, i), full(t, o), full(t, o), full(t, i), full(o, i)

            for product in products.values():
                work.append(2.0 * 2 * n * fan_in * fan_out)
                seconds.append(_cold(make, product, timed))
    if device.type == "cpu":
        return _matmul_fit(work, seconds, len(work) // len(widths))
    rate, _ = _fit(work, seconds)  # widths of 1024 and more say nothing of a launch: time a tiny one
    return rate, _tiny_matmul_latency(device, dtype, rate, timed)


def _tiny_matmul_latency(device: torch.device, dtype: torch.dtype, rate: float, timed) -> float:
    """What a 64 x 64 product takes beyond its flops at ``rate``: an accelerator's matmul latency."""
    tiny, out = torch.full((64, 64), 0.5, device=device, dtype=dtype), torch.empty(64, 64, device=device, dtype=dtype)
    return max(0.0, timed(lambda: torch.mm(tiny, tiny, out=out)) - 2 * 64**3 / rate)


def _matmul_fit(work: list[float], seconds: list[float], small: int) -> tuple[float, float]:
    """(rate, latency) of matmuls taking ``seconds`` for ``work`` flops: the rate fitted by
    least squares over all of them, the latency the median of what the first ``small`` (the
    smaller width's products, where it matters) took beyond their flops at that rate. The
    least squares' own intercept is set by the largest products' noise: at 4 ranks on a 2-core
    Xeon it moved from 36 to 289 us over 3 repeats of the same calibration, whose
    small products' median excess was 48 to 58 us; a BERT, GPT-2 and Llama step of one
    micro-batch of 4 measured 0.90-1.03x its price on the former in 2 calibrations, 1.01-1.07x
    on the latter."""
    rate, _ = _fit(work, seconds)
    latency = statistics.median(t - x / rate for x, t in zip(work[:small], seconds[:small]))
    return rate, max(0.0, latency)


def _math_rates(device: torch.device, timed) -> dict[str, float]:
    """Output elements per second of the ops a CPU computes slower than it streams their bytes
    (exp and its relatives), on 4M elements; only where slower than a copy of the same bytes."""
    aten, f = torch.ops.aten, torch.nn.functional
    x = torch.randn(1024, 4096, device=device)  # 16 MiB: from memory, as the large ones (logits) are
    # Each backward gets what it gets in a step (its forward's output): speed depends on values.
    # Only the op itself is timed: its inputs are made before (a tanh inside tanh_backward's
    # timing priced it at a tenth of its rate).
    y, ly, g, t, a = torch.softmax(x, -1), torch.log_softmax(x, -1), torch.randn_like(x), torch.tanh(x), x.abs()
    ops = {
        "aten.exp": lambda: torch.exp(x),
        "aten.tanh": lambda: torch.tanh(x),
        "aten.tanh_backward": lambda: aten.tanh_backward(g, t),
        "aten.sigmoid": lambda: torch.sigmoid(x),
        "aten._softmax": lambda: torch.softmax(x, -1),
        "aten._softmax_backward_data": lambda: aten._softmax_backward_data(g, y, -1, x.dtype),
        "aten._log_softmax": lambda: torch.log_softmax(x, -1),
        "aten._log_softmax_backward_data": lambda: aten._log_softmax_backward_data(g, ly, -1, x.dtype),
        "aten.gelu": lambda: f.gelu(x),
        "aten.gelu_backward": lambda: aten.gelu_backward(g, x),
        "aten.silu": lambda: f.silu(x),
        "aten.silu_backward": lambda: aten.silu_backward(g, x),
        "aten.pow": lambda: torch.pow(x, 3.0),
        "aten.rsqrt": lambda: torch.rsqrt(a),
        "aten.sqrt": lambda: torch.sqrt(a),
    }
    out = torch.empty_like(x)
    copy = timed(lambda: out.copy_(x))
    rates = {name: x.numel() / seconds for name, op in ops.items() if (seconds := timed(op, 3)) > copy}
    return rates


def _score_rates(device: torch.device, timed, rate: float) -> dict[str, float]:
    """Scores per second of the attention ops beyond their matmul flops at ``rate``: the fp32
    forward and backward that F.scaled_dot_product_attention reaches on ``device`` (its kernel
    is the device's choice), timed on heads of a few sizes (64x32 to 256x64), the mean over
    them of (time - flops / rate) / scores; none where the flops alone account for the time."""
    per_op: dict[str, list[float]] = {}
    for b, h, s, d in ((4, 4, 64, 32), (2, 4, 128, 64), (1, 4, 256, 64)):
        q = torch.randn(b, h, s, d, device=device, requires_grad=True)
        g = torch.randn(b, h, s, d, device=device)
        with _AttentionCalls() as calls:  # the ops the public function dispatches to, and their backward
            torch.nn.functional.scaled_dot_product_attention(q, q, q).backward(g)
        for func, args, kwargs, cost in calls.calls:
            seconds = timed(lambda func=func, args=args, kwargs=kwargs: func(*args, **kwargs), 3)
            per_op.setdefault(cost.op, []).append((seconds - cost.flops / rate) / cost.scores)
    return {op: 1 / statistics.fmean(c) for op, c in per_op.items() if statistics.fmean(c) > 0}


_FRESH = 32 * 2**20  # glibc's largest mmap threshold (64-bit): blocks this large are mapped afresh


def _fresh_pages(timed) -> dict[str, Any]:
    """The first-touch rate of a freshly allocated 64 MiB block (above ``_FRESH``): writing it
    new each time, less writing it in place."""
    n = 2 * _FRESH // 4
    reused = torch.empty(n)
    extra = timed(lambda: torch.empty(n).fill_(1.0), 3) - timed(lambda: reused.fill_(1.0), 3)
    return {"fresh_threshold": float(_FRESH), "fresh_bandwidth": 4 * n / extra} if extra > 0 else {}


def _tiny_step(device: torch.device, timed, depth: int, checkpointed: bool) -> tuple[float, int]:
    """Seconds and aten ops of a training step of a tiny model: 4 blocks of ``depth`` x (Linear,
    LayerNorm, GELU) on 8 features, AdamW, each block checkpointed or not (its work negligible)."""
    from memfit._checkpoint import checkpoint_module

    torch.manual_seed(0)
    layers = lambda: [torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()]  # noqa: E731
    blocks = [torch.nn.Sequential(*[m for _ in range(depth) for m in layers()]) for _ in range(4)]
    model = torch.nn.Sequential(*blocks).to(device)
    for b in blocks if checkpointed else ():
        checkpoint_module(b)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.ones(2, 8, device=device)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in a planned step
    with CostRecorder() as recorder:
        step()
    return timed(step, 15), len(recorder.ops)


def _op_overhead(device: torch.device, timed) -> dict[str, float]:
    """``op_overhead``: seconds per aten op of the tiny model's plain step (dispatch, autograd,
    module calls and the optimizer's loop: what every op of a real step pays beside its work);
    ``checkpoint_block`` and ``checkpoint_op``: what checkpointing its blocks adds beyond the
    added ops at ``op_overhead``, per block and per added op, fitted on blocks of 1 and of 4
    layers (see [Note: The planner's time model])."""
    plain, n = _tiny_step(device, timed, 1, False)
    t_op = plain / n
    extra = []  # (added ops per block, seconds per block beyond them at t_op)
    for depth in (1, 4):
        (p, n_p), (c, n_c) = _tiny_step(device, timed, depth, False), _tiny_step(device, timed, depth, True)
        extra.append(((n_c - n_p) / 4, (c - p - (n_c - n_p) * t_op) / 4))
    (a1, e1), (a4, e4) = extra
    per_op = max(0.0, (e4 - e1) / (a4 - a1))
    return {"op_overhead": t_op, "checkpoint_block": max(0.0, e1 - a1 * per_op), "checkpoint_op": per_op}


def _offload_bandwidth(device: torch.device, big: torch.Tensor, timed) -> float:
    if device.type == "cpu":
        return _disk_bandwidth(big)
    host = torch.empty(big.shape, pin_memory=True)
    return big.nbytes / timed(lambda: host.copy_(big))


def _disk_bandwidth(t: torch.Tensor) -> float:
    data = t.numpy().tobytes()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "probe")

        def write_read():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with open(path, "rb") as f:
                f.read()

        return 2 * len(data) / _best_seconds(write_read, repeats=3)


# [Note: Calibrating the links]
# `calibrate_group` measures what a job's ranks see, in the group they train in:
# - compute: every rank calibrates at the same time (on a host whose cores the ranks share, each
#   rank's rates are its share), each op's median repeat, not its fastest (the fastest is one
#   where the other ranks left the cores alone, which a step does not see), each repeat as many
#   calls as take 20 ms at least (_windowed: with more ranks than cores, a call of a few us to
#   ms mostly runs in one of its rank's time slices while the others wait; timed call by call,
#   the tiny step's cost per op was 4.6 us at 4 ranks on this 2-core machine as at 2, and whole
#   BERT and Llama steps of all 4 ranks at once measured 1.14x to 1.28x their price; in windows,
#   8 to 14 us); then each figure the median of every rank's: timings that the other ranks'
#   phases shift (a tiny step's cost per op: 12.6 to 23.9 us from rank to rank at W=2 here; on
#   rank 0's figures alone one 4-rank calibration priced a BERT step at 908 ms that measured
#   347 ms, another at 268);
# - links: the group times memfit's own all-gather and reduce-scatter (memfit/_shard/
#   _collectives: on gloo a reduce-scatter is an all-to-all on two ranks and an all-reduce on
#   more, fitted as one) and torch's all-reduce (DDP's) at sizes from 16 KiB to 16 MiB, each the slowest
#   rank's time, the median of a few. One latency per ring step and one bandwidth are fitted to
#   all of them by least squares on the ring formulas of [Note: Pricing communication] (W - 1
#   steps and (W - 1) / W of the bytes; an all-reduce twice that): the intra-node link of the
#   group's size (ranks_per_node = W: one host). The same is fitted for each smaller group size
#   that divides W (group_links), in groups of that size all timing at once as a hybrid layout's
#   shard and replica groups run: with 4 gloo ranks on this 2-core machine, a 2-rank group's
#   ring step was not the 4-rank fit's, and hybrid 2 x 2 steps priced on the 4-rank link
#   measured 1.42-1.54x their price where fully sharded ones measured 1.17-1.29x;
# - collective_overlap and layout_overheads: forward and backward passes of 4 small blocks, each
#   a memfit unit, in every layout of the group (fully sharded; with the whole world, hybrid for
#   each shard size dividing it and replicated on memfit's units), at two widths (the same
#   collectives, 4x the bytes) and two batches (the same collectives beside 4x the compute),
#   less the same passes unsharded. The overlap: how much of the extra hiding the time model
#   expects beside the larger batch the passes show (least squares over the pairs, clamped to
#   0..1), fitted on an accelerator only (not measured yet); on a CPU 0, as gloo's threads share
#   the compute's cores. With 4 gloo ranks on this 2-core machine the fit gave 0 to 0.23 (7
#   runs, 5 of them 0.01 or less): the passes took as long beyond the unsharded ones with 4x the
#   compute (width 128, fully sharded: 222 and 240 ms) where the overlap model hid 41 ms more;
#   with 2 ranks, whose links are faster and hide less, 0 in 5 of 8 runs and 0.75, 0.88 and 1 in
#   the others, and the grid priced with 1 measured 1.08-1.42x its prices. Then per layout, what
#   the passes took beyond the communication that overlap exposes, fitted as a cost per
#   collective (hooks, buffers' copies, waits, the ranks' skew) and one per byte sent: what the
#   link's time alone misses where the collectives share the compute's cores and memory. Per
#   layout because they differ: with 4 ranks here (7 runs), per collective beyond the link's
#   figures, 0-0.9 ms fully sharded, 1.4-2.0 ms hybrid 2 x 2 (two collectives per unit's
#   gradients, each in a 2-rank group), 0.4-2.1 ms replicated (an all-reduce over 4 ranks).
# `calibrate` in one process has no link figures: its profile prices collectives on the "cpu"
# profile's. Until the overhead subtracted the modelled exposure instead of all the ring time
# (hidden or not), and gloo's reduce-scatter over 3+ ranks was priced as the all-reduce it is
# (scatter_by_all_reduce), fully sharded steps at 4 ranks measured a median 1.37x their price,
# hybrid ones 1.20x; then 1.17-1.29x and 1.42-1.54x (two runs): one fully sharded fit for every
# layout left hybrid units (two collectives per unit's gradients) under-priced. Since the
# overlap, the per-layout pairs and the windows, see docs/planning.md for what
# benchmarks/autoconfig.py measures of them against real steps.
_LINK_SIZES = [2**k for k in (14, 16, 18, 20, 22, 24)]  # bytes: 16 KiB .. 16 MiB


def calibrate_links(group=None, device: str | torch.device = "cpu", repeats: int = 5) -> dict[str, Any]:
    """The link figures of ``group`` (a DeviceProfile's intra_node_* and inter_node_* fields,
    and ranks_per_node), fitted on collectives timed in it; every rank of the group must call
    it. See [Note: Calibrating the links]."""
    import torch.distributed as dist

    from memfit._shard import _collectives as c

    w = dist.get_world_size(group)
    if w < 2:
        raise ValueError("memfit calibrate_links: a group of one rank has no links to time; run it on 2 or more")
    device = torch.device(device)
    # on gloo memfit reduce-scatters over more than 2 ranks by an all-reduce: 2 rings of bytes
    by_all_reduce = device.type == "cpu" and c._is_gloo(group)
    scatter_rings = 2 if w > 2 and by_all_reduce else 1
    work: list[tuple[float, float]] = []
    seconds: list[float] = []
    for nbytes in _LINK_SIZES:
        n = max(w, nbytes // 4 // w * w)
        full, shard = torch.ones(n, device=device), torch.ones(n // w, device=device)
        send = torch.ones(n, device=device)  # the reduce-scatter's to lose: its values do not matter

        def gather(full=full, shard=shard) -> None:
            c.all_gather(full, shard, group).wait()

        def reduce(send=send, shard=shard) -> None:
            c.reduce_scatter(shard, send, group).wait()

        def all_reduce(full=full) -> None:
            dist.all_reduce(full, group=group)

        for rings, op in ((1, gather), (scatter_rings, reduce), (2, all_reduce)):
            times = []
            for _ in range(repeats + 1):
                dist.barrier(group)
                _sync(device)
                t0 = time.perf_counter()
                op()
                _sync(device)
                times.append(_slowest(time.perf_counter() - t0, group, device))
            work.append((rings * (w - 1), rings * 4.0 * n * (w - 1) / w))  # (ring steps, ring bytes)
            seconds.append(statistics.median(times[1:]))  # after a warm-up
    latency, bandwidth = _fit_link(work, seconds)
    return {
        "intra_node_bandwidth": bandwidth,
        "intra_node_latency": latency,
        "inter_node_bandwidth": bandwidth,
        "inter_node_latency": latency,
        "ranks_per_node": w,
        "scatter_by_all_reduce": by_all_reduce,
    }


def _group_links(group, device: torch.device) -> tuple[tuple[int, float, float], ...]:
    """(ranks, latency, bandwidth) of every smaller group size g of ``group`` (2 <= g, a divisor
    of its size: a hybrid layout's shard or replica groups), fitted by calibrate_links in
    groups of g consecutive ranks, all of that size at once, as a layout runs them; this
    rank's group's figures. See [Note: Calibrating the links]."""
    import torch.distributed as dist

    w = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(w))
    backend = dist.get_backend(group)
    out = []
    for g in (g for g in range(2, w) if w % g == 0):
        subgroups = [dist.new_group(ranks[k : k + g], backend=backend) for k in range(0, w, g)]  # every rank makes each
        mine = subgroups[dist.get_rank(group) // g]
        fitted = calibrate_links(mine, device)
        out.append((g, fitted["intra_node_latency"], fitted["intra_node_bandwidth"]))
        dist.barrier(group)
        dist.destroy_process_group(mine)
    return tuple(out)


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (an accelerator's collectives return before they end)."""
    if device.type == "cpu":
        return
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is not None and current.type == device.type:
        torch.accelerator.synchronize(device)
    else:  # pragma: no cover (an accelerator that is not the current one's type)
        torch.get_device_module(device.type).synchronize()


def _slowest(seconds: float, group, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (on ``device``: NCCL reduces device tensors only)."""
    import torch.distributed as dist

    took = torch.tensor([seconds], dtype=torch.float64, device=device)  # float64: a byte count to the byte too
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return took.item()


def _fit_link(work: list[tuple[float, float]], seconds: list[float]) -> tuple[float, float]:
    """Least squares of seconds = steps x latency + bytes / bandwidth: (latency >= 0, bandwidth)."""
    latency, per_byte = _fit_two(work, seconds)
    return latency, 1 / max(per_byte, 1e-30)


def _fit_two(work: list[tuple[float, float]], seconds: list[float]) -> tuple[float, float]:
    """Least squares of seconds = x a + y b over ``work``'s (x, y): (a, b), both >= 0 (a
    negative one dropped and the other refitted alone)."""
    (s11, s12, s22), (b1, b2) = [0.0, 0.0, 0.0], [0.0, 0.0]
    for (x, y), t in zip(work, seconds):
        s11, s12, s22, b1, b2 = s11 + x * x, s12 + x * y, s22 + y * y, b1 + x * t, b2 + y * t
    det = s11 * s22 - s12 * s12
    a, b = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if a < 0:  # y alone explains the times (a link: bytes alone)
        a, b = 0.0, b2 / s22
    elif b < 0:  # x alone does (a link: bandwidth beyond what the sizes can show)
        a, b = b1 / s11, 0.0
    return max(a, 0.0), max(b, 0.0)


class _Block(torch.nn.Module):
    """A transformer block's MLP, small: the unit of the sharded passes _collective_costs times."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down, self.norm = (
            torch.nn.Linear(width, 4 * width),
            torch.nn.Linear(4 * width, width),
            torch.nn.LayerNorm(width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


Point = tuple[float, float, float, float, float]  # collectives, bytes, extra seconds, overlapped, link time


def _collective_costs(
    group,
    device,
    links: dict[str, Any],
    widths: tuple[int, ...] = (128, 256),
    rows: tuple[int, ...] = (64, 256),
    micro: int = 3,
    fit_overlap: bool | None = None,
) -> tuple[float, tuple[tuple[int, float, float], ...]]:
    """(collective_overlap, layout_overheads) of the time model on the fitted links (``links``,
    :func:`calibrate_links`): ``micro`` forward and backward passes of 4 blocks, each a memfit
    unit, in every layout of the group (fully sharded; hybrid and replicated where the group is
    every rank), for each width and batch of ``rows``, less the same passes unsharded; the
    time model's exposed communication for them (their blocks computing as the unsharded passes
    measured, backward twice forward; [Note: Pricing communication]) with all its link time
    hidden where it can be, and with none. Each run: the median of 5 after 2, between barriers,
    the slowest rank's. ``fit_overlap``: fit the overlap (default: on an accelerator); else it
    is 0, as on a CPU, whose collectives' threads share the compute's cores. See
    [Note: Calibrating the links]."""
    import torch.distributed as dist

    from memfit._plan import _comm
    from memfit._shard import FullyShardedDataParallel
    from memfit._shard._collectives import STATS
    from memfit._shard._layout import end_mesh, hybrid_mesh

    w, device = dist.get_world_size(group), torch.device(device)
    every = group is None or w == dist.get_world_size()
    layouts = [w, *(s for s in range(w - 1, 0, -1) if w % s == 0 and every)]
    linked = dataclasses.replace(  # the overlap model's exposure, nothing added (see _fit_costs)
        PROFILES["cpu"],
        **links,
        collective_overhead=0.0,
        collective_byte_overhead=0.0,
        collective_overlap=1.0,
        layout_overheads=(),
    )

    def passes(model, x: torch.Tensor) -> float:
        runs = []
        for _ in range(7):
            dist.barrier(group)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(micro):
                model(x).sum().backward()
            _sync(device)
            runs.append(_slowest(time.perf_counter() - t0, group, device))
        return statistics.median(runs[2:])

    def counted() -> tuple[int, float]:  # memfit's collectives so far, and their bytes
        return STATS.all_gathers + STATS.reduce_scatters + STATS.all_reduces, STATS.bytes

    def blocks(width: int) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[_Block(width) for _ in range(4)]).to(device)

    inputs = {(width, n): torch.randn(n, width, device=device) for width in widths for n in rows}
    alone = {shape: passes(blocks(shape[0]), x) for shape, x in inputs.items()}
    # per layout: (collectives, bytes sent, seconds beyond the unsharded passes, exposed with
    # the overlap, link time), per width and rows
    points: dict[int, list[Point]] = {}
    for s in layouts:
        mesh = hybrid_mesh(s, "memfit calibrate_group", device.type) if s < w else None
        for width in widths:
            plain = blocks(width)
            block = float(sum(p.numel() * p.element_size() for p in plain[0].parameters()))
            sharded = FullyShardedDataParallel(
                plain, auto_wrap_policy={_Block}, group=None if mesh else group, mesh=mesh, device=device
            )
            k = len(plain)
            for n in rows:
                before = counted()
                together = passes(sharded, inputs[width, n])
                calls, sent = ((after - was) / 7 for after, was in zip(counted(), before))
                forward = alone[width, n] / micro / k / 3  # a block's forward; its backward twice that
                units = _comm.Units(0.0, 0.0, [block] * k, [block] * k, 0.0, 0.0, [forward] * k, [2 * forward] * k)
                t = _comm.micro_batch_comm(units, w, s, True, True, linked)
                extra = together - alone[width, n]
                points.setdefault(s, []).append(
                    (calls, sent, extra, micro * t["exposed_communication"], micro * t["communication"])
                )
        if mesh is not None:  # its groups are this calibration's: ended, not left to the process
            del sharded, plain  # the units hold the groups: freed with them
            dist.barrier(group)
            end_mesh(mesh)
    return _fit_costs(points, len(rows), device.type != "cpu" if fit_overlap is None else fit_overlap)


def _fit_costs(
    points: dict[int, list[Point]], per_width: int, fit_overlap: bool
) -> tuple[float, tuple[tuple[int, float, float], ...]]:
    """(collective_overlap, layout_overheads) from ``points``: per shard size, per width, one
    point per batch (``per_width`` of them, fewest rows first): the collectives and bytes of the
    passes, the seconds they took beyond the unsharded passes, and the time model's exposure of
    their communication with all hidden it can be (overlapped) and with none (link time). The
    overlap: over each width's fewest and most rows (the same collectives beside more compute),
    how much of the added hiding the time model expects the seconds show (least squares, 0..1;
    0 unless ``fit_overlap``); then per layout, seconds = h x overlapped + (1 - h) x link time
    + collectives x per call + bytes x per byte, the last two fitted (>= 0)."""
    if per_width < 2:
        raise ValueError("memfit calibrate_group: the overlap needs two batch sizes per width")
    if not any(pts[0][0] for pts in points.values()):  # no collectives (one rank): nothing to fit
        return (1.0 if fit_overlap else 0.0), ()
    same = [pts[i : i + per_width] for pts in points.values() for i in range(0, len(pts), per_width)]
    pairs = [(few[2] - many[2], few[3] - many[3]) for few, *_, many in same]
    den = sum(e * e for _, e in pairs)
    overlap = min(1.0, max(0.0, sum(x * e for x, e in pairs) / den)) if den > 0 and fit_overlap else 0.0
    per_layout = []
    for s, pts in points.items():
        left = [x - overlap * e - (1 - overlap) * busy for _, _, x, e, busy in pts]
        per_call, per_byte = _fit_two([(c, b) for c, b, *_ in pts], left)  # calls x per call + bytes x per byte
        per_layout.append((s, per_call, per_byte))
    return overlap, tuple(per_layout)


def _median_profile(profiles: list[DeviceProfile]) -> DeviceProfile:
    """Every rate and cost of ``profiles`` (each rank's calibration) the median over them, the
    rest the first's. See [Note: Calibrating the links]."""

    def median(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, float):
            return statistics.median(values)
        if isinstance(first, dict):
            return {k: median([v[k] for v in values]) for k in first if all(k in v for v in values)}
        if isinstance(first, tuple) and all(len(v) == len(first) for v in values):
            return tuple(median(list(column)) for column in zip(*values))
        return first

    fields = {f.name: median([getattr(p, f.name) for p in profiles]) for f in dataclasses.fields(profiles[0])}
    return dataclasses.replace(profiles[0], **fields)


def calibrate_group(group=None, device: str | torch.device | None = None, *, cpu_time: bool = False) -> DeviceProfile:
    """This job's rates, measured in its process group of 2 or more ranks: every rank
    calibrates its compute at once, then the links (see [Note: Calibrating the links]); every
    rank returns rank 0's profile. ``device``: default the CPU on gloo, this rank's current
    GPU on NCCL. One host is assumed: ranks_per_node is the group's size and the inter-node
    figures are the intra-node ones (a group across hosts gets one blended link). Not cached:
    a job calls it, or `memfit calibrate --world-size W` caches it. memfit's collective
    counters (memfit/_shard/_collectives.STATS) are left as they were."""
    import copy

    import torch.distributed as dist

    from memfit._shard._collectives import STATS

    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    device = torch.device(device)
    counters = copy.deepcopy(STATS)
    try:
        mine = calibrate(device, save=False, cpu_time=cpu_time, typical=True)
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        mine = _median_profile(every)
        links = calibrate_links(group, device)
        links["group_links"] = _group_links(group, device)
        overlap, per_layout = _collective_costs(group, device, links)
        per_call, per_byte = per_layout[0][1:] if per_layout else (0.0, 0.0)  # fully sharded's
    finally:
        STATS.__dict__.update(counters.__dict__)
    source = f"{mine.source} by {w} ranks" if (w := dist.get_world_size(group)) > 1 else mine.source
    mine = dataclasses.replace(mine, source=source, calibrated_ranks=w)
    box = [
        dataclasses.replace(
            mine,
            name=f"calibrated-{device.type}",
            collective_overhead=per_call,
            collective_byte_overhead=per_byte,
            layout_overheads=per_layout,
            collective_overlap=overlap,
            **links,
        )
    ]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    return box[0]


# [Note: The default device profile]
# A plan's times are priced on the profile named by ``device_profile``; without one, on the
# named profile of the device the model is on (an accelerator by its name, a CPU or the meta
# device: "cpu"). A cached `memfit calibrate` is used only when asked for ("calibrated"): a
# calibration made once on a loaded machine must not change later plans behind the user's
# back (one made under load priced a 0.5 s step at 16.9 s), and the same call must give the
# same plan on every machine. Plan.table() and `memfit plan` say which profile priced the step.
def device_profile(spec: str | DeviceProfile | None = None, device_type: str = "cpu") -> DeviceProfile:
    """The profile ``spec`` names: a DeviceProfile as is, a name from PROFILES, "calibrated"
    (this machine's cached calibration, measured now if there is none), or None: the named
    profile of ``device_type`` (:func:`default_profile`), never the cache."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None:
        return default_profile(device_type)
    if spec == "calibrated":
        cached = cache_path(torch.device(device_type).type)
        if cached.exists():
            return DeviceProfile(**json.loads(cached.read_text()))
        return calibrate(device_type)
    if spec not in PROFILES:
        raise ValueError(
            f"memfit.plan: unknown device profile {spec!r}; choose one of {sorted(PROFILES)}, 'calibrated' "
            "(this machine, measured once by `memfit calibrate`) or a memfit DeviceProfile"
        )
    return named_profile(spec)


def check_ranks(profile: DeviceProfile, world_size: int, who: str) -> None:
    """Warn when ``profile`` was calibrated with another number of ranks than ``world_size``:
    its per-rank compute was measured while that many ranks shared the machine, and its links
    and collective overhead over that many (a 1-rank calibration has no links at all)."""
    n = profile.calibrated_ranks
    if n and n != world_size:
        warnings.warn(
            f"{who}: the device profile {profile.name!r} was calibrated with {n} rank{'s' * (n > 1)} and this "
            f"plan is for world size {world_size}: per-rank compute and collective times depend on the ranks "
            f"sharing the machine. Run `memfit calibrate --world-size {world_size}` (or calibrate_group in "
            "the job) for prices at this size.",
            stacklevel=3,
        )


__all__ = ["calibrate", "calibrate_group", "calibrate_links", "device_profile", "save_profile"]
