"""The planner's time model: operation counts priced on a device profile, never a stopwatch."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# [Note: The planner's time model]
# Timing a block under load gives a different number each run (identical layers were timed at
# 195-917 ms on a busy 2-core CPU), and a plan that follows those numbers changes from run to
# run. The planner prices work instead: every aten op of a step is recorded once (under
# FakeTensorMode, so nothing runs) with its floating-point operations (torch's flop formulas)
# and the bytes it reads and writes, and an op costs
#     t(op) = max(flops / F[dtype] + t_mm + scores / S[op], bytes / BW(bytes), elements / M[op])
#             + fresh + t_op
# on a device profile:
#   F, t_mm  the matmul rate per dtype and what a matmul costs beyond its flops (only for ops
#            with flops: small matmuls on a CPU run below F);
#   S[op]    attention ops only: the rate at which the kernel gets through its b*h*sq*sk scores
#            beyond its matmul flops (on a CPU each score takes an exp and a rescale, and the
#            per-head tiles run below F: 4x4 heads of 64x32 ran at 57 GFLOP/s here against 100
#            for a large matmul);
#   BW       the memory bandwidth, per size of op where calibrated;
#   M[op]    the element rate of ops whose arithmetic bounds them (exp, softmax, GELU, sqrt on a
#            CPU: 5-10x slower than their bytes);
#   fresh    on a CPU, an output of 32 MiB or more pays for its fresh pages (malloc maps such
#            blocks anew: a fresh 32 MiB fill took 13.8 ms here, a reused one 0.7 ms);
#   t_op     what an op pays in a training step beside its work (dispatch, autograd, module
#            calls, the optimizer's loop), the constant that dominates small ops on a CPU.
# Views and metadata ops (view, t, transpose, detach) move no bytes and cost t_op; prim ops
# (prim.device) never reach a kernel and profiler ops only mark ranges: they cost nothing.
# `memfit calibrate` fits F and t_mm to matmuls of several sizes and BW to elementwise ops of
# several sizes (least squares on time = work / rate + constant; both on data out of cache: see
# [Note: Calibrating on cold data]), times M per op on 4M elements, fits S to attention ops of a
# few shapes, and t_op and checkpoint's own cost on the training step of a tiny model (its work
# negligible); every time is the fastest of a few repeats (another process on the machine only
# ever adds time). The extra time of a decision is what it adds to a step: the block's forward
# and backward recorded under the decision and priced, less the same under keep, plus what
# checkpointing costs beside the ops it adds (DeviceProfile.checkpoint_time: its frame,
# saved-tensor hooks and RNG replay, in Python):
#     keep       0
#     full       the block's forward again (recomputed in backward, up to the last op whose
#                output backward needs), checkpoint's own ops (a detach per saved tensor) and
#                checkpoint_time
#     selective  the same for the ops its rule does not keep
#     offload    full + 2 x the block input's bytes / BW_offload (written in forward, read back)
# and the predicted step time is sum t(op) over one measured step (forward, backward, optimizer
# step) plus the extra times. The same model, batch and profile give the same numbers: the
# same plan. Profiles are named (published peak rates: optimistic, as every roofline is) or
# measured once on this machine by `memfit calibrate` and cached.


@dataclass(frozen=True)
class DeviceProfile:
    """Rates the time model prices operations at.

    Fields:
        name: how tables and caches call it.
        flops: floating-point operations per second of a large matrix multiply, per dtype name
            ("float32", "bfloat16", "float16"); other dtypes use float32's.
        memory_bandwidth: bytes per second an elementwise op streams through device memory.
        offload_bandwidth: bytes per second to where "offload" puts a block's input (host
            memory over PCIe for an accelerator, disk for a CPU).
        op_overhead: seconds to dispatch one op (kernel launch, framework and autograd overhead).
        source: where the numbers come from.
        matmul_latency: seconds an op with flops costs beyond flops / rate (0: none).
        bandwidth_curve: (bytes moved, bytes per second) measured at several sizes, ascending:
            an op moving that many bytes streams at that rate (interpolated on log bytes; a
            CPU's caches make small ops faster than memory). Empty: memory_bandwidth always.
        math_rates: output elements per second of ops whose arithmetic, not their bytes,
            bounds them on this device (exp, softmax, GELU, ... on a CPU), by op name
            ("aten.exp"); measured by `memfit calibrate`. Empty: bytes bound them.
        score_rates: attention scores per second beyond the op's matmul flops, by op name
            ("aten._scaled_dot_product_flash_attention_for_cpu"): what a CPU's attention kernel
            spends on the softmax of its b*h*sq*sk scores and on its small per-head tiles;
            measured by `memfit calibrate`. Empty: flops bound attention as any matmul.
        checkpoint_block, checkpoint_op: what a checkpointed block costs beside the ops it adds
            (its recompute and checkpoint's own ops, priced as any op): the Python of its frame,
            saved-tensor hooks and RNG replay, per block and per added op; measured by `memfit
            calibrate` on a tiny model's blocks. 0 in the named profiles: their op_overhead
            stands for all the host's work, which an accelerator's queue hides.
        fresh_threshold, fresh_bandwidth: an output of ``fresh_threshold`` bytes or more is
            written to pages the operating system maps on first touch (glibc's malloc maps
            blocks of 32 MiB and more afresh each time), at ``fresh_bandwidth`` bytes per
            second on top of its work; a caching allocator (an accelerator's) has no such cost.
        intra_node_*, inter_node_*, ranks_per_node: the links collectives run over (see
            [Note: Pricing communication]); 0: no figures.
        collective_overhead: seconds each collective of a step (sharded or replicated) adds beyond
            its time on the link, on the compute thread: issuing it, waiting for it, the copies
            into and out of its buffers, the ranks' skew. Measured by calibrate_group (see
            [Note: Calibrating the links]); 0 in the named profiles (an accelerator's streams
            hide the host's part).
        collective_byte_overhead: seconds per byte a collective sends that a step pays beyond its
            time on the link, on the compute thread: where the collectives' copies share the
            compute's cores and memory (gloo on a CPU's ranks) a byte costs a step more than the
            link showed alone. Measured by calibrate_group with collective_overhead; 0 in the named
            profiles.
        layout_overheads: (shard size, collective_overhead, collective_byte_overhead) measured
            for each layout of the calibrated group (shard size W: fully sharded; 1: replicated on
            memfit's units; between: hybrid): a layout listed over calibrated_ranks ranks uses
            its own pair, any other the two fields above. Set by calibrate_group; empty in the
            named profiles.
        collective_overlap: how much of the hiding [Note: Pricing communication] gives a
            collective behind the compute of the units around it a step gets (1: all of it, an
            accelerator's communication stream; 0: none, all its link time exposed, where the
            collectives' threads share the compute's cores: gloo on a CPU's ranks). Set by
            calibrate_group (0 on a CPU, fitted on an accelerator); 1 in the named profiles.
        workspace_bytes: device memory a step's allocator holds beside the tensors MemoryMeter
            counts (see [Note: The allocator beside the tensors]); 0 on a CPU.
        scatter_by_all_reduce: memfit's reduce-scatter over more than two ranks runs as an
            all-reduce of the whole buffer, two rings of bytes and steps (gloo on a CPU, which has
            no reduce-scatter of its own; memfit/_shard/_collectives.py): priced so. Set by
            calibrate_group on gloo; False in the named profiles (NCCL's is one ring).
        group_links: (ranks, latency, bandwidth) of the smaller groups a layout's collectives run
            in on the same host (a hybrid layout's shard and replica groups), each measured with
            every group of that size running at once, as the layout runs them; a group of a size
            not listed uses the intra_node_* figures. Set by calibrate_group for the divisors of
            its size (see [Note: Calibrating the links]); empty in the named profiles.
        host_op, kernel_floor, attention_flops, selective_op, shard_unit, shard_param: the
            overlapped model of an accelerator, see [Note: Host and device time]; 0 / empty:
            the serial model (every op's work plus op_overhead, a CPU's).
        profiled_launch: host seconds each kernel launch costs beyond host_op in a process where
            torch.profiler has run with CUDA activities: Kineto leaves CUPTI subscribed after the
            profiler exits unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455; kineto#1539, open, would
            make teardown the default), and every
            launch from then on pays its callbacks. A plan never prices it (a training process
            that never profiles does not pay it); benchmarks/gpu_time_rows.py prices the GPU
            validation's rows timed after a profiled step with it (see [Note: Host and device
            time]). 0: none.
        sources: per field name, where its figure comes from (a data sheet, a published run,
            a fit to named measured rows, a calibration); the named profiles name one for
            every figure they set.
        calibrated_ranks: how many ranks ran while it was measured (`memfit calibrate`: 1,
            calibrate_group: the group's size; the per-rank compute and the collectives
            depend on it: a plan for another world size warns); 0: a named profile.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    offload_bandwidth: float
    op_overhead: float
    source: str = ""
    matmul_latency: float = 0.0
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    math_rates: dict[str, float] = dataclasses.field(default_factory=dict)
    score_rates: dict[str, float] = dataclasses.field(default_factory=dict)
    checkpoint_block: float = 0.0  # seconds a checkpointed block adds beside its added ops' work (see checkpoint_time)
    checkpoint_op: float = 0.0  # and per op it adds, beyond op_overhead
    fresh_threshold: float = 0.0  # outputs of at least this many bytes land in fresh pages (0: none do)
    fresh_bandwidth: float = 0.0  # bytes per second of touching fresh pages the first time
    intra_node_bandwidth: float = 0.0  # bytes/s per rank, one direction (NVLink); 0: no figures
    intra_node_latency: float = 0.0  # seconds per ring step within a node
    inter_node_bandwidth: float = 0.0  # bytes/s per rank, one direction (its network card)
    inter_node_latency: float = 0.0  # seconds per ring step between nodes
    ranks_per_node: int = 8
    collective_overhead: float = 0.0  # seconds a collective adds to a step beyond its link time (see above)
    collective_byte_overhead: float = 0.0  # and per byte it sends (see above)
    workspace_bytes: int = 0  # device memory the allocator holds beside tensors in a step (see above)
    calibrated_ranks: int = 0  # ranks running while it was measured; 0: not measured (see above)
    scatter_by_all_reduce: bool = False  # a reduce-scatter over 3+ ranks is an all-reduce (see above)
    group_links: tuple[tuple[int, float, float], ...] = ()  # (ranks, latency, bandwidth) per smaller group (see above)
    layout_overheads: tuple[tuple[int, float, float], ...] = ()  # (shard size, per collective, per byte) (see above)
    collective_overlap: float = 1.0  # the part of a collective's link time compute can hide (see above)
    # See [Note: Host and device time]: an accelerator's host and device run side by side.
    host_op: float = 0.0  # host seconds per recorded op (dispatch, autograd, Python); > 0: regions overlap
    kernel_floor: float = 0.0  # device seconds a kernel takes at least (overlapped profiles only)
    attention_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # fused attention FLOP/s per dtype
    selective_op: float = 0.0  # host seconds selective's dispatch mode adds per op of its forward and recompute
    shard_unit: float = 0.0  # host seconds a memfit unit's hooks add to a step (at any world size)
    shard_param: float = 0.0  # and per parameter of the unit (casts, gradient copies, views)
    profiled_launch: float = 0.0  # host seconds per kernel launch once torch.profiler has run (see above)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # field name -> where its figure comes from

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth_curve", tuple(tuple(p) for p in self.bandwidth_curve))  # from JSON
        object.__setattr__(self, "group_links", tuple((int(g), lat, bw) for g, lat, bw in self.group_links))
        object.__setattr__(self, "layout_overheads", tuple((int(s), c, b) for s, c, b in self.layout_overheads))
        rates = [*self.flops.values(), self.memory_bandwidth, self.offload_bandwidth]
        if "float32" not in self.flops or min(rates) <= 0 or min(self.op_overhead, self.matmul_latency) < 0:
            raise ValueError(f"memfit.DeviceProfile {self.name!r}: rates must be positive, float32 included")
        links = (self.intra_node_bandwidth, self.intra_node_latency, self.inter_node_bandwidth, self.inter_node_latency)
        per_collective = (self.collective_overhead, self.collective_byte_overhead)
        per_layout = tuple(x for _, c, b in self.layout_overheads for x in (c, b))
        if min(*links, *per_collective, *per_layout) < 0 or self.ranks_per_node < 1:
            raise ValueError(
                f"memfit.DeviceProfile {self.name!r}: link bandwidths, latencies, collective_overhead and "
                f"collective_byte_overhead (layout_overheads' too) must be >= 0 (0: no figures) and "
                f"ranks_per_node >= 1, got {links}, {per_collective}, {self.layout_overheads} and "
                f"ranks_per_node={self.ranks_per_node}"
            )
        if not 0.0 <= self.collective_overlap <= 1.0:
            raise ValueError(
                f"memfit.DeviceProfile {self.name!r}: collective_overlap is the part of a collective's link "
                f"time compute can hide, between 0 and 1; got {self.collective_overlap}"
            )

    def rate(self, dtype: torch.dtype) -> float:
        return self.flops.get(str(dtype).removeprefix("torch."), self.flops["float32"])

    @property
    def overlapped(self) -> bool:
        """Host and device run side by side (an accelerator): see [Note: Host and device time]."""
        return self.host_op > 0

    def _compute(self, cost: OpCost) -> float:
        if cost.scores and self.attention_flops:  # a fused kernel: its own rate, masked tiles skipped
            rate = self.attention_flops.get(str(cost.dtype).removeprefix("torch."), self.rate(cost.dtype))
            return cost.flops * (0.5 if cost.causal else 1.0) / rate
        compute = cost.flops / self.rate(cost.dtype) + self.matmul_latency if cost.flops else 0.0
        if cost.scores and cost.op in self.score_rates:
            compute += cost.scores / self.score_rates[cost.op]
        if cost.op in self.math_rates:
            compute = max(compute, cost.elements / self.math_rates[cost.op])
        return compute

    def op_time(self, cost: OpCost) -> float:
        """Seconds of one op in the serial model: its work, fresh pages and op_overhead."""
        fresh = 0.0
        if self.fresh_bandwidth and self.fresh_threshold and cost.largest_output >= self.fresh_threshold:
            fresh = cost.largest_output / self.fresh_bandwidth
        return max(self._compute(cost), cost.bytes / self.bandwidth(cost.bytes)) + fresh + self.op_overhead

    def device_time(self, cost: OpCost) -> float:
        """Device seconds of one op in the overlapped model (a view or metadata op: none)."""
        if not cost.bytes and not cost.flops:
            return 0.0
        return max(self._compute(cost), cost.bytes / self.bandwidth(cost.bytes)) + self.kernel_floor

    def split(self, costs: list[OpCost], host_extra: float = 0.0) -> tuple[float, float]:
        """(host seconds, device seconds) of a region of ops (overlapped profiles; the serial
        model's host is its op_overhead per op, its device the rest)."""
        if not self.overlapped:
            host = len(costs) * self.op_overhead + host_extra
            return host, sum(self.op_time(c) for c in costs) - len(costs) * self.op_overhead
        return len(costs) * self.host_op + host_extra, sum(self.device_time(c) for c in costs)

    def profiled_time(self, costs: list[OpCost]) -> float:
        """Host seconds a region's kernel launches add in a process torch.profiler has run in
        (``profiled_launch`` per launch; see [Note: Host and device time])."""
        return self.profiled_launch * kernel_launches(costs)

    def ops_time(self, costs: list[OpCost], host_extra: float = 0.0) -> float:
        """Seconds of a region of ops: the larger of its host and device time where they overlap,
        their sum in the serial model; ``host_extra``: host seconds of hooks beside the ops."""
        if not self.overlapped:
            return sum(self.op_time(c) for c in costs) + host_extra
        return max(self.split(costs, host_extra))

    def step_fields(self, forward_backward: list[OpCost], optimizer: list[OpCost]) -> dict[str, Any]:
        """A profile's step_time (its two regions, each priced apart) and step_split (the host
        and device seconds of the forward and backward)."""
        step = self.ops_time(forward_backward) + self.ops_time(optimizer)
        return {"step_time": step, "step_split": self.split(forward_backward)}

    def checkpoint_time(self, added_ops: int) -> float:
        """Seconds a checkpointed block adds to a step beside the priced work of the ``added_ops``
        ops it adds (see ``checkpoint_block``)."""
        return self.checkpoint_block + added_ops * self.checkpoint_op

    def decision_time(self, decision: str, costs: list[OpCost], keep: list[OpCost]) -> float:
        """Seconds a block's decision adds to a step: its forward and backward ops ``costs`` with
        checkpoint's hooks (and selective's dispatch per op), less ``keep``'s (see [Note: The
        planner's time model] and [Note: Host and device time])."""
        if decision == "keep":
            return 0.0
        hooks = self.checkpoint_time(len(costs) - len(keep))
        if decision == "selective":
            hooks += self.selective_op * len(costs)
        return max(0.0, self.ops_time(costs, hooks) - self.ops_time(keep))

    def offload_time(self, nbytes: float, forward: float) -> float:
        """Seconds offloading a block's input of ``nbytes`` adds beside full checkpointing: written
        in forward, read back in backward; where host and device overlap, the copies run on a
        side stream behind the block's compute (its ``forward`` and a backward of twice that)."""
        copies = 2 * nbytes / self.offload_bandwidth
        return max(0.0, copies - 3 * forward) if self.overlapped else copies

    def shard_hooks(self, units: int, params: int) -> float:
        """Host seconds memfit's units' hooks add to a step: ``units`` units holding ``params``
        parameters in all."""
        return units * self.shard_unit + params * self.shard_param

    def bandwidth(self, nbytes: float) -> float:
        """Bytes per second of an op moving ``nbytes`` (see ``bandwidth_curve``)."""
        curve = self.bandwidth_curve
        if not curve:
            return self.memory_bandwidth
        if nbytes <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(curve):
            if nbytes <= x1:
                f = math.log(nbytes / x0) / math.log(x1 / x0)
                return y0 + f * (y1 - y0)
        return curve[-1][1]


# [Note: Host and device time]
# On an accelerator the host (Python, the dispatcher, autograd) queues kernels that the device
# runs later, so a step is not the sum of its ops' work and launches: the host runs ahead until
# the device's work is longer than the host's, or waits while its own is. Each region of a step
# (the forward and backward of the model, of a block under a decision, the optimizer step) costs
#     t(region) = max(host, device)
#     host   = ops x host_op + hooks       every recorded aten op (views included: dispatched too),
#                                          plus memfit's own Python in the region:
#              checkpoint   checkpoint_block per checkpointed block + checkpoint_op per op it adds
#              selective    selective_op per op of its forward and recompute (its dispatch mode's
#                           __torch_dispatch__ runs in Python for every op)
#              sharding     shard_unit per unit + shard_param per parameter (pre/post forward and
#                           backward hooks, mixed precision's casts, the gradients' copies)
#     device = sum over ops of max(compute, bytes / memory_bandwidth) + kernel_floor
#              compute: flops / the achieved matmul rate of the dtype (+ matmul_latency: small
#              shapes run below the rate); a fused attention kernel (an op with scores) flops /
#              attention_flops[dtype], halved when is_causal (the kernel skips masked tiles;
#              torch's flop counter counts the full square); views and metadata ops: none
# What the GPU validation's rows measured beside a user's step: a row timed in a process where
# torch.profiler had already run (part c profiles each row after timing it) pays CUPTI's
# callbacks on every kernel launch (Kineto does not tear CUPTI down: pytorch/pytorch#144455),
# priced as profiled_launch x the region's kernel launches (ops that move bytes or do flops,
# counted from the traced stream). It is why part c's BERT-large bf16 step at batch 8 (0.1051 s,
# host-bound) is slower than part b's at batch 16 (0.0832 s, timed before any profiler ran): the
# same op stream, the same AdamW (foreach), zero_grad(set_to_none), autocast and event timing,
# 2,673 launches x 8.2 us (inferred from the harness and the rows, not timed both ways on a
# GPU; the llama rows, held out, agree). host_op is fitted on the clean row (part b),
# profiled_launch on part c's; a plan never pays it.
# Collectives run on their own stream at the achieved NCCL bus bandwidth of the link ([Note:
# Pricing communication]; a ring's time is bytes x (g - 1) / g / busbw, which is how nccl-tests
# defines busbw). A profile with host_op = 0 is the serial model of [Note: The planner's time
# model] (a CPU, whose host is the device). Every figure of a named profile names its source in
# DeviceProfile.sources: a data sheet, a published measurement, or a fit to named rows of
# benchmarks/results/gpu_h100.json (benchmarks/gpu_time_rows.py --fit; at most a third of the
# rows, the rest held out: docs/planning.md); `memfit calibrate` on the device measures them and a
# committed benchmarks/results/profile_<name>.json replaces the named figures (named_profile).
#
# Sources of the accelerator figures below (one direction per GPU for links):
#   peaks: NVIDIA H100 SXM / H200 SXM / A100 80GB SXM data sheets (fp32 without TF32, PyTorch's
#     matmul default); achieved matmul rates: bf16 and fp16 as published for torch.matmul at 4096^3
#     on an H100 80GB HBM3 (788.7 and 760 TFLOP/s; 1024^3 and 2048^3 ran 9.4 and 3.6 us beyond that
#     rate: matmul_latency 5 us), fp32 fitted on the H100 (_H100_FIT; the same source: 51.9), the
#     A100's the H100's efficiency (achieved / peak) on its own peaks;
#   fused attention: FlashAttention-2 (Dao 2023, arXiv:2307.08691): forward+backward up to
#     335 TFLOP/s bf16 on H100 SXM, 225 on A100 (PyTorch's flash SDPA backend is FlashAttention-2);
#     fp32 (the memory-efficient kernel, without tensor cores): the fp32 matmul rate (a fit on BERT's
#     fp32 kernel time put no time on it: no figure of its own);
#   memory bandwidth: 90% of the data sheet's (what a device-to-device copy reaches: an assumption
#     until a calibration on the device replaces it);
#   offload: pinned host copies measured on the H100, 55.1 GB/s (gpu_h100.md part e); the A100's
#     PCIe Gen4 x16 at the same 86% of line rate (27.5 GB/s);
#   links: NVLink H100/H200 busbw ~370 GB/s (nccl-tests issue 212, NCCL's author: 450 GB/s line
#     rate less ~20% protocol overhead); A100 ~200 GB/s (nccl-tests issues 149 and 178: 8 x A100
#     NVLink all_reduce busbw 200-208 GB/s); between nodes one 400 Gb/s NDR (H100) or 200 Gb/s
#     HDR (A100) card per GPU at the same 80% of line rate: 40 and 20 GB/s; latencies 3 us within
#     and 10 us between nodes per ring step (assumed, the order nccl-tests shows);
#   kernel_floor: 2 us per kernel (assumed: back-to-back launches of tiny kernels);
#   host_op, checkpoint_block, selective_op, shard_unit, shard_param, profiled_launch: fitted on the H100's host
#     (see _H100_FIT); another host's CPU changes them: calibrate there.
# [Note: The allocator beside the tensors]
# On CUDA the caching allocator also hands out memory no tensor owns: cuBLAS keeps a workspace
# per thread and stream, and a step runs matmuls on two threads (the forward's and autograd's
# backward's). Measured on an H100 (torch 2.11, benchmarks/results/gpu_h100.md, part d): BERT-
# large's step peaked 70 MiB above MemoryMeter's live tensor bytes, the forecast of its plan
# 0.5% under the allocator's peak. The forecast adds it as the term "workspace" at every moment.
# The allocator's cached, unused blocks (fragmentation) are not forecast: `memfit train` turns on
# expandable segments (PYTORCH_CUDA_ALLOC_CONF), which keep them small.
CUDA_WORKSPACE = 70 * 2**20

# Fitted by `benchmarks/gpu_time_rows.py --fit` to the rows of gpu_h100.json it names (a third
# of the rows at most; the rest held out). See [Note: Host and device time].
_H100_FIT = {
    "float32": 4.456e13,  # achieved fp32 matmul FLOP/s (c bert-large fp32 plain's kernel time)
    "bfloat16": 788.7e12,  # published: torch.matmul bf16 4096^3 on an H100 80GB HBM3 (see sources)
    "host_op": 1.658e-05,  # host seconds per op (b bf16 autocast none: timed before any profiler ran)
    "checkpoint_block": 1.248e-03,  # a checkpoint frame beside its recompute's ops (b bf16 autocast memfit full)
    "selective_op": 1.920e-05,  # selective's dispatch per op (b bf16 autocast memfit selective)
    "shard_unit": 3.235e-03,  # a unit's hooks (c bert-large bf16 memfit: kernels 0.33 of its step)
    "shard_param": 0.0,  # not told apart from shard_unit at one rank: fitted per unit only
    "profiled_launch": 8.222e-06,  # CUPTI's callbacks per launch after torch.profiler (c bert-large bf16 plain)
}
_PUBLISHED_MM = "github.com/zzc0721/torch-performance-test-data issue 79 (H100 80GB HBM3, torch 2.7)"
_FIT_SOURCE = "fitted to gpu_h100.json rows by benchmarks/gpu_time_rows.py --fit"
_PEAKS = {"h100": (67e12, 989e12, 3.35e12), "h200": (67e12, 989e12, 4.8e12), "a100": (19.5e12, 312e12, 2.039e12)}


def _accelerator(name: str) -> DeviceProfile:
    """A named accelerator profile: achieved rates, fitted host costs and NCCL's bus bandwidth,
    each with its source (see [Note: Host and device time])."""
    fp32, bf16, hbm = _PEAKS[name]
    h100_fp32, h100_bf16 = _PEAKS["h100"][:2]
    matmul = {"float32": fp32 * _H100_FIT["float32"] / h100_fp32, "bfloat16": bf16 * _H100_FIT["bfloat16"] / h100_bf16}
    matmul["float16"] = bf16 * 760.0e12 / h100_bf16  # the same source's fp16 figure
    a100 = name == "a100"
    sheet = {"h100": "NVIDIA H100 SXM", "h200": "NVIDIA H200 SXM", "a100": "NVIDIA A100 80GB SXM"}[name] + " data sheet"
    attention = 225e12 if a100 else 335e12
    host = ("host_op", "checkpoint_block", "selective_op", "shard_unit", "shard_param", "profiled_launch")
    sources = {
        "flops": f"bf16/fp16: {_PUBLISHED_MM}; fp32: {_FIT_SOURCE} (the same source: 51.9 TFLOP/s at 4096^3); "
        f"{'the H100s efficiency on the ' + sheet + ' peaks' if name != 'h100' else ''}",
        "matmul_latency": f"{_PUBLISHED_MM}: what its 1024^3 and 2048^3 bf16 products take beyond 788.7 TFLOP/s "
        "(9.4 and 3.6 us)",
        "memory_bandwidth": f"90% of {sheet}'s {hbm / 1e12:.2f} TB/s (assumed)",
        "offload_bandwidth": "gpu_h100.md part e: pinned copies 55.1 GB/s" + (", scaled to PCIe Gen4" if a100 else ""),
        "attention_flops": f"bf16/fp16: FlashAttention-2 (Dao 2023), fwd+bwd on {'A100' if a100 else 'H100 SXM'}; "
        "fp32: none (the fp32 matmul rate)",
        "intra_node_bandwidth": f"nccl-tests issue{'s 149/178 (A100' if a100 else ' 212 (H100'} busbw)",
        "inter_node_bandwidth": f"{'HDR 200' if a100 else 'NDR 400'} Gb/s per GPU at 80% of line rate",
        "intra_node_latency": "assumed", "inter_node_latency": "assumed", "kernel_floor": "assumed",
        "workspace_bytes": "gpu_h100.md part d", "op_overhead": "unused where host_op is set",
        **{k: _FIT_SOURCE + (" (the H100's host)" if name != "h100" else "") for k in host},
    }  # fmt: skip
    return DeviceProfile(
        name,
        matmul,
        0.9 * hbm,
        27.5e9 if a100 else 55.1e9,
        5e-6,
        sheet,  # the achieved rates and host costs: their own sources
        workspace_bytes=CUDA_WORKSPACE,
        intra_node_bandwidth=200e9 if a100 else 370e9,
        intra_node_latency=3e-6,
        inter_node_bandwidth=20e9 if a100 else 40e9,
        inter_node_latency=10e-6,
        kernel_floor=2e-6,
        matmul_latency=5e-6,
        attention_flops={
            "bfloat16": attention,
            "float16": attention,
        },
        sources=sources,
        host_op=_H100_FIT["host_op"],
        checkpoint_block=_H100_FIT["checkpoint_block"],
        selective_op=_H100_FIT["selective_op"],
        shard_unit=_H100_FIT["shard_unit"],
        shard_param=_H100_FIT["shard_param"],
        profiled_launch=_H100_FIT["profiled_launch"],
    )


PROFILES = {
    "h100": _accelerator("h100"),
    "h200": _accelerator("h200"),
    "a100": _accelerator("a100"),
    # A modest CPU: the default for a model on a CPU or the meta device, fixed so that plans are
    # the same everywhere (device_profile="calibrated" prices on this machine's measured rates).
    # Its links are gloo over TCP, assumed (not measured): 1 GB/s and 50 us per ring step on one
    # host, 1 GB/s (10 Gb/s Ethernet) and 100 us between hosts.
    "cpu": DeviceProfile(
        "cpu",
        {"float32": 50e9},
        10e9,
        1e9,
        10e-6,
        "fixed rates of a modest CPU; 'calibrated' measures this one",
        sources={"*": "fixed rates of a modest CPU (assumed, the same on every machine)"},
        intra_node_bandwidth=1e9,
        intra_node_latency=50e-6,
        inter_node_bandwidth=1e9,
        inter_node_latency=100e-6,
    ),
}


@dataclass(frozen=True)
class OpCost:
    """One aten op of a recorded step: what the time model prices."""

    op: str  # overload packet name, e.g. "aten.addmm"
    flops: int
    bytes: int  # read and written
    dtype: torch.dtype
    elements: int = 0  # of its outputs
    largest_output: int = 0  # bytes of its largest output
    scores: int = 0  # attention ops: elements of the b*h*sq*sk score matrix they compute through
    causal: bool = False  # attention ops called with is_causal: a fused kernel skips the masked half


def _sdpa_cpu(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch counts the CUDA attention kernels; the CPU one has the same arithmetic.
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    getattr(aten, name): count
    for name, count in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward),
    )
    if hasattr(aten, name)
}


def _nbytes(items) -> tuple[int, torch.dtype | None]:
    total, dtype, seen = 0, None, set()
    for t in items:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
    return total, dtype


# Ops that return a view or only metadata: no data moves (aten.detach and friends are views).
_NO_DATA = {"aten._unsafe_view", "aten.alias", "aten.lift_fresh", "aten.size", "aten.stride", "aten.sym_size"}


def _scores(name: str, args) -> int:
    """Elements of the score matrix an attention op computes through (b*h*sq*sk; 0 for others)."""
    if "scaled_dot_product" not in name:
        return 0
    q, k = args[1:3] if name.endswith("_backward") else args[0:2]  # a backward gets grad_out first
    return math.prod(q.shape[:-1]) * k.shape[-2]


def op_cost(func, args, kwargs, out) -> OpCost:
    packet = func._overloadpacket
    if func.is_view or str(packet) in _NO_DATA:
        return OpCost(str(packet), 0, 0, torch.float32)
    flops = 0
    if packet in flop_registry:
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
    elif packet in _EXTRA_FLOPS:
        flops = int(_EXTRA_FLOPS[packet](*args, **kwargs, out_val=out))
    read, dtype = _nbytes(tree_flatten((args, kwargs))[0])
    outs = tree_flatten(out)[0]
    written, out_dtype = _nbytes(outs)
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    elements = sum(t.numel() for t in tensors)
    largest = max((t.numel() * t.element_size() for t in tensors), default=0)
    dtype = dtype or out_dtype or torch.float32
    scores = _scores(str(packet), args)
    causal = bool(scores) and _is_causal(func, args, kwargs)
    return OpCost(str(packet), flops, read + written, dtype, elements, largest, scores, causal)


def _is_causal(func, args, kwargs) -> bool:
    """The ``is_causal`` argument of an attention op (False where its schema has none)."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return False
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    i = names.index("is_causal")
    return bool(args[i]) if i < len(args) else False


def kernel_launches(costs: list[OpCost]) -> int:
    """Kernels a region of recorded ops launches: the ops that move bytes or do flops (a view
    or metadata op launches none; a foreach op is counted once)."""
    return sum(1 for c in costs if c.bytes or c.flops)


class CostRecorder(TorchDispatchMode):
    """Records an :class:`OpCost` per aten op run inside it (with the op, to test a rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[object, OpCost]] = []
        self.recording = True  # False inside paused(): the planner's own copies are not the model's work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # prim.device and the like are answered without a kernel; profiler.* only mark ranges
        if self.recording and func.namespace not in ("prim", "profiler"):
            self.ops.append((func, op_cost(func, args, kwargs, out)))
        return out

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside are not recorded (the planner's copies of a block's inputs)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    @property
    def costs(self) -> list[OpCost]:
        return [c for _, c in self.ops]


# Where the GPU validation commits `memfit calibrate`'s profile of a named device (a checkout of
# the repository: an installed memfit without it uses the named figures).
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# The figures a calibration on the device measures (memfit/_plan/_calibrate_device.py); the rest
# (links, fitted hooks it does not time) stay the named profile's.
MEASURED = (
    "flops", "memory_bandwidth", "offload_bandwidth", "matmul_latency", "bandwidth_curve", "attention_flops",
    "host_op", "kernel_floor", "checkpoint_block", "checkpoint_op", "profiled_launch",
)  # fmt: skip


def named_profile(name: str, results: Path | None = None) -> DeviceProfile:
    """The named profile ``name``; where a calibration on that device is committed
    (``benchmarks/results/profile_<name>.json``) its measured figures replace the named ones, and
    ``sources`` and ``source`` say which: see [Note: Host and device time]."""
    base = PROFILES[name]
    path = (results or RESULTS) / f"profile_{name}.json"
    if not path.is_file():
        return base
    measured = json.loads(path.read_text())
    fields = {k: measured[k] for k in MEASURED if k in measured}
    said = f"measured by memfit calibrate ({path.name}: {measured.get('source', '')})"
    sources = dict(base.sources) | dict.fromkeys(fields, said)
    source = f"{base.source}; measured rates from {path.name}"
    return dataclasses.replace(base, **fields, sources=sources, source=source)


def default_profile(device: str | torch.device = "cpu") -> DeviceProfile:
    """The profile a plan gets when none is named: the named profile of the device it targets,
    the same on every run (see [Note: The default device profile])."""
    device = torch.device(device)
    if device.type == "cpu":
        return PROFILES["cpu"]
    module = torch.get_device_module(device.type)
    name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type
    for key in ("h200", "h100", "a100"):  # H200 before H100: no name holds both
        if key in name.lower().replace(" ", ""):
            return named_profile(key)
    raise ValueError(
        f"memfit.plan: no named device profile for {name!r} ({device}); pass device_profile= one of "
        f"{sorted(PROFILES)}, 'calibrated' (measured on this machine by `memfit calibrate`) or a memfit.DeviceProfile"
    )


__all__ = [
    "MEASURED", "PROFILES", "CostRecorder", "DeviceProfile", "OpCost", "default_profile", "kernel_launches",
    "named_profile",
]  # fmt: skip
