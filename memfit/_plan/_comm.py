"""The time model's communication: a step's collectives priced per link, and what of them the
compute does not hide. See [Note: Pricing communication]."""

from __future__ import annotations

from dataclasses import dataclass

from memfit._plan._time import PROFILES, DeviceProfile

# [Note: Pricing communication]
# A sharded step moves, per unit (the root: everything outside the blocks; each block), in a
# ring over a group of g ranks, (g - 1) / g of the unit's full bytes per rank and collective
# (the bytes memfit/_shard/_collectives counts), in g - 1 steps:
#     t(all-gather)     = (g - 1) x latency + P x (g - 1) / g / bandwidth
#     t(reduce-scatter) = (g - 1) x latency + G x (g - 1) / g / bandwidth
#     t(all-reduce)     = 2 x t(reduce-scatter)             (a reduce-scatter, then an all-gather)
# on the link the group spans: g consecutive ranks (a shard group) within ranks_per_node talk
# over the intra-node link (NVLink), anything wider (a replica group, strided by the shard size,
# spans shard_size x (g - 1) + 1 ranks) over the inter-node one (its slowest hop bounds a ring).
# A calibrated profile may hold the link of each smaller group size on its host (group_links,
# measured with every group of that size running at once): a group within the node uses it.
# Per micro-batch, sharded over s ranks with r = W / s replicas:
#   (where the profile says scatter_by_all_reduce, gloo on a CPU, a reduce-scatter over s > 2
#   ranks is memfit's all-reduce of the whole buffer: twice t(reduce-scatter) on the link; the
#   bytes counted stay the reduce-scatter's, as memfit's counters count them)
#   forward   all-gather every unit (the root first);
#   backward  all-gather every block again (reshard_after_forward=True; none when False), then
#             after its backward reduce-scatter its gradients over the s ranks and, with r > 1,
#             all-reduce the 1/s shard over the r replicas; the root's last (its gradients are
#             whole until the end of backward, see [Note: Sharded forecasts]);
#   replicated (s = 1, DDP-style) all-reduce every block's gradients over W ranks, only in the
#             last micro-batch's backward (the others run under no_sync).
# Overlap: one link, one compute stream. A unit's all-gather is issued when the unit before it
# starts computing (one unit prefetched, as FSDP2 does) and the unit waits for it; its
# reduce-scatter is issued when its backward ends and runs behind the next unit's compute. The
# link serves collectives in the order issued. Exposed communication is the phase's end (the
# later of the last compute and the last collective) less its compute: what did not hide behind
# the next unit's compute. A block's backward compute is taken as 2x its priced forward (the two
# matmuls per forward matmul of a Linear layer), its recompute added to it. Where the
# collectives' threads share the compute's cores (gloo on a CPU) nothing hides: the profile's
# collective_overlap h scales the hiding above, exposing
#     h x (what the overlap above exposes) + (1 - h) x (all the link time);
# 1 in the named profiles (no measure of theirs; the "cpu" profile's links are nominal too),
# 0 in a calibrate_group profile of a CPU, fitted on an accelerator.
# Each collective also costs the compute thread the profile's collective_overhead (issuing it,
# waiting, its buffers' copies, the ranks' skew) and collective_byte_overhead per byte it sends
# (where the copies share the compute's cores), always exposed; calibrate_group measures the
# pair for each layout of its group (layout_overheads: fully sharded, hybrid, replicated), 0 in
# the named profiles.
# Nothing here was measured on an accelerator; on gloo, benchmarks/autoconfig.py compares it
# with measured steps.


@dataclass(frozen=True)
class Link:
    """The link a group's ring runs over."""

    name: str  # "intra-node" or "inter-node"
    bandwidth: float  # bytes per second one rank sends, one direction
    latency: float  # seconds per ring step


def link(device: DeviceProfile, ranks: int, stride: int = 1) -> Link:
    """The link of a group of ``ranks`` ranks ``stride`` apart (see [Note: Pricing communication]);
    a profile without link figures (a calibration) prices on the "cpu" profile's."""
    figures = device if device.intra_node_bandwidth and device.inter_node_bandwidth else PROFILES["cpu"]
    if (ranks - 1) * stride + 1 <= figures.ranks_per_node:
        for size, latency, bandwidth in figures.group_links:  # measured at this group size
            if size == ranks:
                return Link("intra-node", bandwidth, latency)
        return Link("intra-node", figures.intra_node_bandwidth, figures.intra_node_latency)
    return Link("inter-node", figures.inter_node_bandwidth, figures.inter_node_latency)


def ring_bytes(nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``nbytes`` over ``ranks``."""
    return nbytes * (ranks - 1) / ranks


def all_gather_time(nbytes: float, ranks: int, via: Link) -> float:
    """Seconds of an all-gather whose result is ``nbytes`` (a reduce-scatter of ``nbytes`` costs the same)."""
    if ranks == 1 or not nbytes:  # nothing to send: no collective is issued
        return 0.0
    return (ranks - 1) * via.latency + ring_bytes(nbytes, ranks) / via.bandwidth


reduce_scatter_time = all_gather_time


def all_reduce_time(nbytes: float, ranks: int, via: Link) -> float:
    return 2 * all_gather_time(nbytes, ranks, via)


def phase_end(compute: list[float], before: list[float], after: list[float]) -> tuple[float, float]:
    """(end, link busy) of a phase of units computing in turn: unit i waits for its collective
    ``before[i]`` (issued when unit i - 1 starts; the first at 0), and issues ``after[i]`` when
    it ends; one link serves them in the order issued (see [Note: Pricing communication])."""
    link_free = before[0] if before else 0.0
    ready = [link_free] + [0.0] * (len(compute) - 1)
    clock = 0.0
    for i, seconds in enumerate(compute):
        start = max(clock, ready[i])
        if i + 1 < len(compute) and before[i + 1]:  # prefetch the next unit's all-gather
            link_free = max(link_free, start) + before[i + 1]
            ready[i + 1] = link_free
        clock = start + seconds
        if after[i]:
            link_free = max(link_free, clock) + after[i]
    return max(clock, link_free), sum(before) + sum(after)


@dataclass(frozen=True)
class Units:
    """What the communication of a step depends on, per rank: the units' bytes and compute."""

    root_params: float  # parameter bytes outside the blocks (the root unit)
    root_grads: float
    block_params: list[float]
    block_grads: list[float]
    root_forward: float  # seconds: the root's forward (embeddings, head, loss)
    root_backward: float
    block_forward: list[float]
    block_backward: list[float]  # recompute included


def micro_batch_comm(units: Units, world_size: int, shards: int, reshard: bool, last: bool, device: DeviceProfile):
    """Named terms of one micro-batch's communication (seconds and ring bytes per rank):
    ``last``: the micro-batch after which gradients must be reduced (DDP-style replication
    reduces only then). See [Note: Pricing communication]."""
    s, r = shards, world_size // shards
    n = len(units.block_params)
    t: dict[str, float] = {"all_gather_bytes": 0.0, "reduce_scatter_bytes": 0.0, "all_reduce_bytes": 0.0}
    fwd_compute = [units.root_forward, *units.block_forward]
    bwd_compute = [units.root_backward, *units.block_backward[::-1], 0.0]  # the root's reduce last
    if s > 1:
        shard_link = link(device, s)
        gathers = [units.root_params, *units.block_params]
        fwd_before = [all_gather_time(p, s, shard_link) for p in gathers]
        again = units.block_params[::-1] if reshard else [0.0] * n
        bwd_before = [0.0, *(all_gather_time(p, s, shard_link) for p in again), 0.0]
        grads = [0.0, *units.block_grads[::-1], units.root_grads]
        replica = link(device, r, stride=s)
        rings = 2 if device.scatter_by_all_reduce and s > 2 else 1  # gloo: an all-reduce
        bwd_after = [rings * reduce_scatter_time(g, s, shard_link) + all_reduce_time(g / s, r, replica) for g in grads]
        t["all_gather_bytes"] = sum(ring_bytes(p, s) for p in gathers) + sum(ring_bytes(p, s) for p in again)
        t["reduce_scatter_bytes"] = sum(ring_bytes(g, s) for g in grads)
        t["all_reduce_bytes"] = sum(2 * ring_bytes(g / s, r) for g in grads)
    else:
        fwd_before, bwd_before = [0.0] * (n + 1), [0.0] * (n + 2)
        grads = [0.0, *units.block_grads[::-1], units.root_grads] if last and world_size > 1 else [0.0] * (n + 2)
        everyone = link(device, world_size)
        bwd_after = [all_reduce_time(g, world_size, everyone) for g in grads]
        t["all_reduce_bytes"] = sum(2 * ring_bytes(g, world_size) for g in grads) if world_size > 1 else 0.0
    fwd_end, fwd_busy = phase_end(fwd_compute, fwd_before, [0.0] * (n + 1))
    bwd_end, bwd_busy = phase_end(bwd_compute, bwd_before, bwd_after)
    t["communication"] = fwd_busy + bwd_busy  # link time, hidden or not
    # each collective's host work is on the compute thread: exposed (see collective_overhead)
    t["collectives"] = float(sum(1 for x in (*fwd_before, *bwd_before) if x) + _issued(grads, s, r, world_size))
    sent = t["all_gather_bytes"] + t["reduce_scatter_bytes"] + t["all_reduce_bytes"]
    per_call, per_byte = overheads(device, s, world_size)
    overlapped = (fwd_end - sum(fwd_compute)) + (bwd_end - sum(bwd_compute))
    h = device.collective_overlap
    t["exposed_communication"] = (
        h * overlapped + (1 - h) * t["communication"] + t["collectives"] * per_call + sent * per_byte
    )
    return t


def overheads(device: DeviceProfile, shards: int, world_size: int) -> tuple[float, float]:
    """(seconds per collective, seconds per byte sent) the compute thread pays beyond the link
    time in a layout of ``shards`` shards over ``world_size`` ranks: the profile's measure of
    that layout where it has one (layout_overheads, measured at calibrated_ranks ranks: a
    layout of another world size is another layout), else its collective_overhead and
    collective_byte_overhead."""
    if device.calibrated_ranks == world_size:
        for size, per_call, per_byte in device.layout_overheads:
            if size == shards:
                return per_call, per_byte
    return device.collective_overhead, device.collective_byte_overhead


def _issued(grads: list[float], s: int, r: int, world_size: int) -> int:
    """Gradient collectives one micro-batch issues, as memfit's units do (memfit train runs
    every layout on them, replicated as a mesh of W x 1): sharded, a reduce-scatter per unit
    with gradients (and an all-reduce over the replicas with r > 1); replicated, an all-reduce
    per unit with gradients (torch DDP buckets them instead: a 1 MiB first bucket, then 25 MiB)."""
    units = sum(1 for g in grads if g)
    if s > 1:
        return units * (1 + (r > 1))
    return units if world_size > 1 else 0


__all__ = [
    "Link",
    "Units",
    "all_gather_time",
    "all_reduce_time",
    "link",
    "micro_batch_comm",
    "overheads",
    "phase_end",
    "reduce_scatter_time",
    "ring_bytes",
]
