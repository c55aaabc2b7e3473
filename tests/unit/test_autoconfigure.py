"""memfit.autoconfigure's search and the time model's communication, on hand-built profiles
and a fake device: no model runs. The arithmetic is the same as the code's, so comparisons
are exact up to float rounding (pytest.approx, rel 1e-6)."""

import dataclasses
import json
import math
import weakref
from types import SimpleNamespace

import pytest
import torch

import memfit
from memfit._plan import _comm as comm
from memfit._plan._autoconfig import Layout, Search, held_gradients, micro_batch_sizes
from memfit._plan._profile import DECISIONS
from memfit._plan._profile_types import BlockProfile, ModelProfile
from memfit._plan._solve import Sharding, _Moments, forecast, smallest_budget
from memfit._plan._time import PROFILES as NAMED
from memfit._plan._time import OpCost
from memfit.testing import fake_allocator

# A device whose links are slow enough for communication to matter: 4 ranks a node.
FAKE = memfit.DeviceProfile(
    "fake",
    {"float32": 1e9},
    1e9,
    1e8,
    0.0,
    intra_node_bandwidth=1e7,
    intra_node_latency=1e-5,
    inter_node_bandwidth=1e6,
    inter_node_latency=1e-4,
    ranks_per_node=4,
)
OPT = [OpCost("aten._foreach_lerp_", flops=0, bytes=200_000, dtype=torch.float32, elements=50_000)]  # 0.2 ms on FAKE
N_BLOCKS, P_BLOCK, P_ROOT = 4, 4_000, 8_000


def profile_of(b: int) -> ModelProfile:
    """A model whose activations and compute grow with the micro-batch ``b``, its state not."""
    blocks = []
    for i in range(N_BLOCKS):
        kept = {"keep": 1_000 * b, "selective": 500 * b, "full": 100 * b, "offload": 0}
        peak = {d: kept[d] + 2_000 * b for d in DECISIONS}
        extra = {"keep": 0.0, "selective": 3e-4 * b, "full": 1e-3 * b, "offload": 1.5e-3 * b}
        blocks.append(BlockProfile(f"b{i}", P_BLOCK, P_BLOCK, 100 * b, 100 * b, kept, peak, 1e-3 * b + 1e-4, extra))
    params = N_BLOCKS * P_BLOCK + P_ROOT
    # state = parameters + AdamW's two moments; a step: 3 x (blocks' forward) + the root's + the optimizer
    step = 3 * sum(blk.forward_time for blk in blocks) + 2e-3 * b + FAKE.ops_time(OPT)
    return ModelProfile(
        blocks, 3 * params, params, 2 * params, P_ROOT, 200 * b, 100 * b, 1_500 * b, 4 * params, step_time=step
    )


SIZES, W = [1, 2, 4, 8], 8
LAYOUTS = [Layout(W, 1), *(Layout(W, s, r) for s in (2, 4, 8) for r in (True, False))]


def search(budget: int, global_batch: int | None = 64, **kw) -> memfit.AutoConfig:
    s = Search(budget, W, global_batch, FAKE, OPT, tokens=128, **kw)
    return s.run(profile_of, SIZES, LAYOUTS)


def test_the_pick_has_the_most_tokens_per_second_among_those_that_fit():
    result = search(budget=80_000)
    fits = [c for c in result.candidates if c.fits]
    assert {c.fits for c in result.candidates} == {True, False}  # the budget rules some out
    assert result.best.tokens_per_second == max(c.tokens_per_second for c in fits)
    assert result.tokens_per_second == 64 * 128 / result.step_time
    # fits are ranked by tokens/s after the pick; each one's plan is memfit.plan's at the budget
    assert [c.tokens_per_second for c in fits] == sorted((c.tokens_per_second for c in fits), reverse=True)
    for c in fits:
        assert c.peak <= 80_000
        sharding = c.layout.sharding
        plan = memfit.plan(
            torch.nn.Linear(1, 1),
            torch.ones(1),
            budget=80_000,
            world_size=W,
            shard_size=c.layout.shard_size,
            profile=accumulating(profile_of(c.micro_batch), c),
            device_profile=FAKE,
        )
        if sharding.reshard_after_forward:  # memfit.plan forecasts resharding layouts
            assert plan.decisions == c.plan.decisions and plan.predicted_peak == c.peak


def accumulating(profile, c):
    """``profile`` with the gradients held beyond one micro-batch: the accumulated ones (1/s
    each) where the forward starts and in the backward before the blocks."""
    grads = profile.grad_rest_bytes + sum(b.grad_bytes for b in profile.blocks)
    accumulated = -(-grads // c.layout.shard_size) if c.accumulation > 1 else 0
    return dataclasses.replace(
        profile,
        accumulating=c.accumulation > 1,
        before_blocks=profile.before_blocks + accumulated,
        tail_transient=profile.tail_transient + accumulated,
    )


def test_the_global_batch_is_kept_and_micro_batches_divide_it():
    result = search(budget=120_000)
    assert {c.micro_batch * c.accumulation * W for c in result.candidates} == {64}
    assert micro_batch_sizes(8, 64, None, 64) == [1, 2, 4, 8]
    assert micro_batch_sizes(4, 48, None, 64) == [1, 2, 4, 12]  # powers of two dividing 12, and 12
    assert micro_batch_sizes(2, None, None, 20) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="global_batch 30 is not a multiple of world_size 8"):
        micro_batch_sizes(8, 30, None, 64)
    with pytest.raises(ValueError, match=r"micro_batches \[3\] do not divide the 8 samples"):
        micro_batch_sizes(8, 64, [2, 3], 64)
    free = search(budget=120_000, global_batch=None)  # accumulation 1: the global batch follows b
    assert {c.accumulation for c in free.candidates} == {1}


def test_runner_ups_say_why_they_lost():
    result = search(budget=80_000)
    assert result.best.lost == ""
    for c in result.candidates[1:]:
        if c.fits:
            assert c.lost.startswith("time: ") and c.tokens_per_second <= result.tokens_per_second
        else:  # its peak is the smallest budget any plan of it fits: above this one
            assert c.lost.startswith("memory: needs ") and c.peak > 80_000
    table = result.table()
    assert table.count("\n* ") == 1 and "chosen: micro-batch" in table and "exposed communication" in table


def test_the_fastest_loses_on_memory_below_its_smallest_budget():
    """With room for all, the pick is the fastest; below the smallest budget any plan of it fits
    it loses on memory, and the pick is the fastest of what still fits."""
    roomy = search(budget=10**7)
    fastest = roomy.best
    floor = smallest_budget(profile_of(fastest.micro_batch), fastest.layout.sharding)
    below = int(floor * 0.995)  # smallest_budget bisects to 1/2000 of it: 0.5% below is below
    tight = search(budget=below)
    assert (tight.micro_batch, tight.layout) != (fastest.micro_batch, fastest.layout)
    same = [c for c in tight.candidates if (c.micro_batch, c.layout) == (fastest.micro_batch, fastest.layout)]
    assert not same[0].fits and same[0].lost.startswith("memory") and same[0].peak >= below
    fits = [c for c in roomy.candidates if c.peak <= below]  # fits at the tight budget keeping everything
    assert tight.tokens_per_second >= max(c.tokens_per_second for c in fits)


def test_sizes_above_one_that_fits_no_layout_are_not_profiled():
    seen = []

    def counting(b):
        seen.append(b)
        return profile_of(b)

    s = Search(50_000, W, 64, FAKE, OPT, tokens=128)
    result = s.run(counting, SIZES, LAYOUTS)
    assert seen == [1, 2, 4] and result.skipped == (8,)
    assert not any(c.fits for c in result.candidates if c.micro_batch == 4)
    with pytest.raises(memfit.PlanError, match=r"fits 29.30 KiB per rank\. The smallest budget that fits is 46.22 KiB"):
        search(budget=30_000)


def test_step_time_is_its_named_terms():
    result = search(budget=10**7)
    for c in result.candidates:
        t, p = c.time, profile_of(c.micro_batch)
        s = c.layout.shard_size
        assert t["compute"] == pytest.approx(c.accumulation * (p.step_time - FAKE.ops_time(OPT)))
        assert t["recompute"] == pytest.approx(c.accumulation * c.plan.predicted_overhead)
        # the optimizer step over 1/s of the state: 200 kB / s at 1 GB/s
        assert t["optimizer"] == pytest.approx(200_000 / s / 1e9)
        assert t["step"] == pytest.approx(t["compute"] + t["recompute"] + t["optimizer"] + t["exposed_communication"])
        assert 0 <= t["exposed_communication"] <= t["communication"] + 1e-12


def test_collectives_cost_their_ring():
    link = comm.Link("intra-node", 1e8, 1e-5)
    # 4 ranks: 3 ring steps of latency, 3/4 of 1 MB sent per rank
    assert comm.all_gather_time(1e6, 4, link) == pytest.approx(3 * 1e-5 + 0.75e6 / 1e8)
    assert comm.reduce_scatter_time(1e6, 4, link) == comm.all_gather_time(1e6, 4, link)
    assert comm.all_reduce_time(1e6, 4, link) == pytest.approx(2 * comm.all_gather_time(1e6, 4, link))
    assert comm.all_gather_time(1e6, 1, link) == 0.0
    # links: 4 consecutive ranks share a node of 4; 8 ranks, or 2 ranks 4 apart, do not
    assert comm.link(FAKE, 4).name == "intra-node" and comm.link(FAKE, 4).bandwidth == 1e7
    assert comm.link(FAKE, 8).name == comm.link(FAKE, 2, stride=4).name == "inter-node"
    assert comm.link(FAKE, 2, stride=2).latency == 1e-5
    # a profile without link figures (a calibration) prices on the cpu profile's
    bare = memfit.DeviceProfile("bare", {"float32": 1e9}, 1e9, 1e8, 0.0)
    assert comm.link(bare, 2) == comm.link(NAMED["cpu"], 2)
    h100 = NAMED["h100"]
    assert comm.link(h100, 8).bandwidth == 370e9 and comm.link(h100, 16).bandwidth == 40e9  # NCCL busbw
    # a smaller group measured on its own (calibrate_group's group_links): its figures, in the node
    # only; the JSON of a cached calibration (lists) reads back as the same profile
    sized = dataclasses.replace(FAKE, group_links=((2, 3e-6, 5e7),))
    assert comm.link(sized, 2) == comm.link(sized, 2, stride=2) == comm.Link("intra-node", 5e7, 3e-6)
    assert comm.link(sized, 4) == comm.link(FAKE, 4) and comm.link(sized, 2, stride=4) == comm.link(FAKE, 2, stride=4)
    assert memfit.DeviceProfile(**json.loads(json.dumps(dataclasses.asdict(sized)))) == sized


def test_communication_hides_behind_the_next_units_compute():
    # forward: all-gathers 0.5, 0.5, 2.0 s, each unit computes 1 s. Unit 0 waits 0.5; unit 1's
    # gather (issued at 0.5) is done at 1.0, before unit 0 ends (1.5); unit 2's (issued at 1.5)
    # ends at 3.5: unit 2 waits 1.0 s. Exposed: 0.5 + 1.0 of the 3.0 s on the link.
    end, busy = comm.phase_end([1.0, 1.0, 1.0], [0.5, 0.5, 2.0], [0.0, 0.0, 0.0])
    assert (end - 3.0, busy) == pytest.approx((1.5, 3.0))
    # backward: reduce-scatters of 0.5 s after each unit; the first hides behind the second
    # unit's compute, the last has nothing after it.
    end, busy = comm.phase_end([1.0, 1.0], [0.0, 0.0], [0.5, 0.5])
    assert (end - 2.0, busy) == pytest.approx((0.5, 1.0))
    # a unit that needs no all-gather does not wait behind a reduce-scatter on the link
    end, _ = comm.phase_end([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [5.0, 0.0, 0.0])
    assert end == pytest.approx(6.0)  # 3 s of compute; the 5 s reduce ends at 6 s


def test_bytes_per_rank_per_micro_batch():
    units = comm.Units(P_ROOT, P_ROOT, [P_BLOCK] * 4, [P_BLOCK] * 4, 1e-3, 2e-3, [1e-3] * 4, [2e-3] * 4)
    blocks = 4 * P_BLOCK
    full = comm.micro_batch_comm(units, 4, 4, True, True, FAKE)
    # forward gathers every unit, backward every block again; gradients reduce-scattered once
    assert full["all_gather_bytes"] == pytest.approx((P_ROOT + 2 * blocks) * 3 / 4)
    assert full["reduce_scatter_bytes"] == pytest.approx((P_ROOT + blocks) * 3 / 4)
    assert full["all_reduce_bytes"] == 0.0
    kept = comm.micro_batch_comm(units, 4, 4, False, True, FAKE)  # no second gather
    assert kept["all_gather_bytes"] == pytest.approx((P_ROOT + blocks) * 3 / 4)
    assert kept["exposed_communication"] <= full["exposed_communication"]
    hybrid = comm.micro_batch_comm(units, 8, 4, True, True, FAKE)  # 2 replicas: all-reduce the 1/4 shard
    assert hybrid["all_reduce_bytes"] == pytest.approx(2 * (P_ROOT + blocks) / 4 * 1 / 2)
    ddp_last = comm.micro_batch_comm(units, 8, 1, True, True, FAKE)
    ddp_other = comm.micro_batch_comm(units, 8, 1, True, False, FAKE)  # under no_sync
    assert ddp_last["all_reduce_bytes"] == pytest.approx(2 * (P_ROOT + blocks) * 7 / 8)
    assert ddp_other["all_reduce_bytes"] == ddp_other["exposed_communication"] == 0.0


def test_a_reduce_scatter_run_as_an_all_reduce_is_priced_as_one():
    """gloo (scatter_by_all_reduce): memfit's reduce-scatter over more than 2 ranks all-reduces
    the whole buffer: twice the link time; over 2 ranks (an all-to-all) and the counted bytes
    unchanged. Backward's compute is 0, so every collective is exposed."""
    units = comm.Units(0.0, P_ROOT, [0.0] * 2, [P_BLOCK] * 2, 0.0, 0.0, [0.0] * 2, [0.0] * 2)
    gloo = dataclasses.replace(FAKE, scatter_by_all_reduce=True)
    for world, rings in ((4, 2), (2, 1)):
        plain, doubled = (comm.micro_batch_comm(units, world, world, True, True, d) for d in (FAKE, gloo))
        scatters = sum(comm.reduce_scatter_time(g, world, comm.link(FAKE, world)) for g in (P_ROOT, P_BLOCK, P_BLOCK))
        assert plain["communication"] == pytest.approx(scatters)
        assert doubled["communication"] == pytest.approx(rings * scatters)
        assert doubled["reduce_scatter_bytes"] == plain["reduce_scatter_bytes"]
    hybrid = comm.micro_batch_comm(units, 4, 2, True, True, gloo)  # 2x2: the shard group's is an all-to-all
    assert hybrid["communication"] == comm.micro_batch_comm(units, 4, 2, True, True, FAKE)["communication"]


def test_blocks_kept_gathered_from_forward_cost_their_parameters():
    """reshard_after_forward=False: at the end of forward every block is whole on top of what
    resharding holds; in block i's backward blocks 0..i are, instead of two blocks."""
    p = profile_of(2)
    keep = ["keep"] * N_BLOCKS
    resharded, kept = Sharding(4), Sharding(4, None, False)
    moments = lambda s: {k: v for k, v in forecast_moments(p, keep, s).items()}  # noqa: E731
    a, b = moments(resharded), moments(kept)
    assert b["end of forward"] - a["end of forward"] == N_BLOCKS * P_BLOCK
    for i in range(N_BLOCKS):
        assert b[f"backward of b{i}"] - a[f"backward of b{i}"] == (i + 1) * P_BLOCK - 2 * P_BLOCK
    assert forecast(p, keep, kept)["peak"] >= forecast(p, keep, resharded)["peak"]
    assert "blocks gathered forward to backward" in kept.describe()


def forecast_moments(profile, decisions, sharding):
    """Every moment of the forecast, by name: the peak of a profile whose moment is made the only large one."""
    out = {}
    for at in ["end of forward", *(f"backward of b{i}" for i in range(N_BLOCKS))]:
        f = forecast(_only(profile, at), decisions, sharding)
        assert f["at"] == at
        out[at] = f["peak"]
    return out


def _only(profile, at):
    """``profile`` with ``at`` the peak moment: a large head for the end of forward, a large
    working set in one block's backward otherwise."""
    if at == "end of forward":
        return dataclasses.replace(profile, head_transient=10**7)
    i = int(at.removeprefix("backward of b"))
    blocks = list(profile.blocks)
    blocks[i] = dataclasses.replace(blocks[i], peak={d: 10**7 for d in DECISIONS})
    return dataclasses.replace(profile, blocks=blocks)


def test_accumulated_gradients_are_held():
    """With accumulation > 1 the gradients so far (1/s of them sharded) are alive in the next
    micro-batch's forward and backward: the forecast adds them where the forward starts. On
    one shard the backward adds into them: none counted beside them (no DDP bucket copy either:
    memfit's replicated units hold none)."""
    result = search(budget=10**7)
    grads = P_ROOT + N_BLOCKS * P_BLOCK
    for c in result.candidates:
        p = held_gradients(profile_of(c.micro_batch), c.layout, c.accumulation)
        extra = -(-grads // c.layout.shard_size) if c.accumulation > 1 else 0
        assert p.before_blocks == profile_of(c.micro_batch).before_blocks + extra
        assert p.tail_transient == profile_of(c.micro_batch).tail_transient + extra
        assert p.optimizer_peak == profile_of(c.micro_batch).optimizer_peak  # no DDP bucket copy
        assert c.peak == forecast(p, list(c.plan.decisions.values()), c.layout.sharding)["peak"]
        moments = _Moments.of(p, c.layout.sharding)
        in_place = c.layout.shard_size == 1 and c.accumulation > 1  # the backward adds into them
        assert (moments.parts["backward before the blocks"]["gradients"] == 0) == in_place
        assert (set(moments.gradients) == {0}) == in_place
        if in_place:  # the backward before the blocks: the state, every gradient, the embeddings' backward
            plain = profile_of(c.micro_batch)
            assert moments.tail == p.state_bytes + grads + plain.tail_transient + p.workspace_bytes


def test_each_collective_adds_the_calibrated_overhead():
    """collective_overhead (calibrate_group's host work per collective) is exposed once per
    collective a micro-batch issues: sharded, a gather per unit in forward, per block again in
    backward when resharded, a reduce-scatter per unit (and an all-reduce over the replicas);
    replicated, an all-reduce per unit, only when gradients reduce."""
    units = comm.Units(P_ROOT, P_ROOT, [P_BLOCK] * 4, [P_BLOCK] * 4, 1e-3, 2e-3, [1e-3] * 4, [2e-3] * 4)
    slow = dataclasses.replace(FAKE, collective_overhead=1e-3)
    for (w, s, reshard, last), count in {
        (4, 4, True, True): 5 + 4 + 5,
        (4, 4, False, True): 5 + 5,
        (8, 4, True, True): 5 + 4 + 5 + 5,
        (8, 1, True, True): 5,
        (8, 1, True, False): 0,
        (1, 1, True, True): 0,
    }.items():
        base = comm.micro_batch_comm(units, w, s, reshard, last, FAKE)
        priced = comm.micro_batch_comm(units, w, s, reshard, last, slow)
        assert base["collectives"] == priced["collectives"] == count, (w, s, reshard, last)
        assert priced["exposed_communication"] - base["exposed_communication"] == pytest.approx(count * 1e-3)
        # and collective_byte_overhead once per byte the micro-batch's collectives send
        per_byte = comm.micro_batch_comm(
            units, w, s, reshard, last, dataclasses.replace(FAKE, collective_byte_overhead=1e-9)
        )
        sent = base["all_gather_bytes"] + base["reduce_scatter_bytes"] + base["all_reduce_bytes"]
        assert (sent > 0) == (count > 0)
        assert per_byte["exposed_communication"] - base["exposed_communication"] == pytest.approx(sent * 1e-9)
    for field in ("collective_overhead", "collective_byte_overhead"):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(FAKE, **{field: -1.0})


def test_a_layout_uses_its_own_overheads_and_the_overlap_scales_the_hiding():
    """layout_overheads (calibrate_group's per layout) replace the two scalar fields for the
    shard size they name; collective_overlap blends the overlap model's exposure (1) with all
    the link time (0)."""
    units = comm.Units(P_ROOT, P_ROOT, [P_BLOCK] * 4, [P_BLOCK] * 4, 1e-3, 2e-3, [1e-3] * 4, [2e-3] * 4)
    scalar = dataclasses.replace(FAKE, collective_overhead=1e-3, collective_byte_overhead=1e-9)
    per_layout = dataclasses.replace(scalar, layout_overheads=((2, 5e-3, 0.0), (1, 0.0, 2e-9)), calibrated_ranks=4)
    for w, s in ((4, 4), (4, 2), (4, 1)):
        base = comm.micro_batch_comm(units, w, s, True, True, FAKE)
        sent = base["all_gather_bytes"] + base["reduce_scatter_bytes"] + base["all_reduce_bytes"]
        per_call, per_byte = {4: (1e-3, 1e-9), 2: (5e-3, 0.0), 1: (0.0, 2e-9)}[s]
        priced = comm.micro_batch_comm(units, w, s, True, True, per_layout)
        added = base["collectives"] * per_call + sent * per_byte
        assert priced["exposed_communication"] - base["exposed_communication"] == pytest.approx(added), (w, s)
        # no overlap: every second on the link is exposed; half: halfway between the two
        none = comm.micro_batch_comm(units, w, s, True, True, dataclasses.replace(FAKE, collective_overlap=0.0))
        half = comm.micro_batch_comm(units, w, s, True, True, dataclasses.replace(FAKE, collective_overlap=0.5))
        assert none["exposed_communication"] == pytest.approx(base["communication"]) and base["communication"] > 0
        assert base["exposed_communication"] < none["exposed_communication"]  # the fake's compute hides some
        middle = (base["exposed_communication"] + none["exposed_communication"]) / 2
        assert half["exposed_communication"] == pytest.approx(middle)
    # measured over 4 ranks: 2 shards of 8 ranks is another layout, priced on the scalar pair
    assert comm.overheads(per_layout, 2, 8) == (1e-3, 1e-9) and comm.overheads(per_layout, 2, 4) == (5e-3, 0.0)
    for bad in ({"collective_overlap": 1.5}, {"collective_overlap": -0.1}, {"layout_overheads": ((2, -1.0, 0.0),)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(FAKE, **bad)


def test_the_layout_costs_are_fitted_back_from_their_passes():
    """calibrate_group's fit (_fit_costs) on passes made from a known overlap and per-layout
    pair: it gives them back; without fit_overlap the overlap is 0 and the pairs absorb what
    the link time adds; with no collectives there is nothing to fit."""
    from memfit._plan._calibrate import _fit_costs

    truth = {4: (1e-3, 2e-9), 2: (3e-3, 1e-9)}  # per layout: seconds per collective, per byte
    h = 0.4

    def points(hidden):
        out = {}
        for s, (a, b) in truth.items():
            pts = []
            for calls, sent, busy in ((60, 2e7, 0.2), (60, 8e7, 0.8)):  # two widths: more bytes, same calls
                for overlapped in (busy * 0.9, busy * 0.5):  # two batches: more compute hides more
                    extra = hidden * overlapped + (1 - hidden) * busy + calls * a + sent * b
                    pts.append((calls, sent, extra, overlapped, busy))
            out[s] = pts
        return out

    overlap, pairs = _fit_costs(points(h), 2, True)
    assert overlap == pytest.approx(h)
    assert {s: (a, b) for s, a, b in pairs} == {s: pytest.approx(v) for s, v in truth.items()}
    # fitted as 0 where nothing hides: the passes' seconds are the pairs' and the link time
    overlap, pairs = _fit_costs(points(0.0), 2, True)
    assert overlap == pytest.approx(0.0, abs=1e-9)
    assert {s: (a, b) for s, a, b in pairs} == {s: pytest.approx(v) for s, v in truth.items()}
    assert _fit_costs(points(h), 2, False)[0] == 0.0
    none = {4: [(0.0, 0.0, 0.01, 0.0, 0.0)] * 2}
    assert _fit_costs(none, 2, False) == (0.0, ())
    with pytest.raises(ValueError, match="two batch sizes"):
        _fit_costs(points(h), 1, True)


def test_windowed_timings_run_as_many_calls_as_fill_the_window():
    """_windowed: one warm-up call sets how many calls make the 20 ms window; the median per
    call over the repeats."""
    from memfit._plan import _calibrate

    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def fn():
        calls.append(1)
        now[0] += 1e-3  # each call takes 1 ms

    assert _calibrate._windowed(fn, 5, clock) == pytest.approx(1e-3)
    assert len(calls) == 1 + 5 * 20


def test_a_link_fit_recovers_its_latency_and_bandwidth():
    from memfit._plan._calibrate import _fit_link, _fit_two

    work = [(steps, nbytes) for steps in (1, 3, 6) for nbytes in (1e4, 1e6, 1e7)]
    seconds = [steps * 5e-5 + nbytes / 2e9 for steps, nbytes in work]
    assert _fit_link(work, seconds) == pytest.approx((5e-5, 2e9), rel=1e-6)
    # bytes alone explain the times: no negative latency
    assert _fit_link([(1, 1e6), (1, 2e6), (3, 1e6)], [0.9e-3, 2.0e-3, 0.8e-3])[0] == 0.0
    # calibrate_group's per-collective costs: two widths (same collectives, 16x the bytes)
    work = [(22, 1e5), (22, 1.6e6)]
    assert _fit_two(work, [22 * 1e-3 + y * 2e-9 for _, y in work]) == pytest.approx((1e-3, 2e-9), rel=1e-6)
    assert _fit_two(work, [-2e-3, -5e-3]) == (0.0, 0.0)  # all of it hidden (an accelerator): nothing


def test_a_groups_profile_takes_the_median_of_its_ranks():
    from memfit._plan._calibrate import _median_profile

    ranks = [
        dataclasses.replace(
            FAKE,
            flops={"float32": rate, "bfloat16": 2 * rate},
            op_overhead=overhead,
            matmul_latency=latency,
            bandwidth_curve=((1e6, bw), (1e8, bw / 2)),
            math_rates={"aten.exp": rate / 100},
            source=f"rank {i}",
        )
        for i, (rate, overhead, latency, bw) in enumerate(
            [(4e10, 2e-5, 0.0, 8e9), (1e10, 9e-5, 3e-4, 6e9), (3e10, 1e-5, 1e-6, 1e10)]
        )
    ]
    group = _median_profile(ranks)
    assert group.flops == {"float32": 3e10, "bfloat16": 6e10}
    assert (group.op_overhead, group.matmul_latency) == (2e-5, 1e-6)  # one rank's outlier does not move it
    assert group.bandwidth_curve == ((1e6, 8e9), (1e8, 4e9)) and group.math_rates == {"aten.exp": 3e8}
    assert (group.source, group.name, group.ranks_per_node) == ("rank 0", FAKE.name, FAKE.ranks_per_node)


def test_measure_picks_the_most_tokens_per_second_expected(monkeypatch):
    from memfit._plan import _trial

    result = search(budget=80_000)
    fits = [c for c in result.candidates if c.fits]
    assert len(fits) > 4
    clock = [0.0]
    monkeypatch.setattr(_trial, "_clock", lambda: clock[0])
    monkeypatch.setattr(_trial, "_ranks", lambda group: W)  # as if on the W ranks searched (no collectives here)
    seconds = {id(fits[0]): 3.0, id(fits[1]): 2.0, id(fits[2]): 1.0}  # a step each: the third predicted is fastest
    built, calls = [], []

    def step_of(c):
        built.append(c)

        def step():
            calls.append(c)
            clock[0] += seconds[id(c)]

        return step

    measured = result.measure(step_of, top=3, steps=5, warmup=2)
    assert built == fits[:3] and calls == [c for c in fits[:3] for _ in range(2 + 5)]
    tried, rest = measured.candidates[:3], measured.candidates[3:]
    key = lambda c: (c.micro_batch, c.accumulation, c.layout)  # noqa: E731
    assert [key(c) for c in tried] == [key(c) for c in fits[2::-1]] and measured.best is tried[0]
    assert [c.measured for c in tried] == [1.0, 2.0, 3.0]  # every global batch 64 samples: tokens/s follow
    assert [c.lost for c in tried] == [
        "",
        "tried: 50.0% fewer tokens/s expected than the pick",
        "tried: 66.7% fewer tokens/s expected than the pick",
    ]
    assert all(c.measured is None for c in rest)
    assert [c.lost for c in rest if c.fits] == ["not measured: priced below the top 3"] * (len(fits) - 3)
    assert [c.lost for c in rest if not c.fits] == [c.lost for c in result.candidates if not c.fits]
    # the trials' scale: the median measured / priced of the three run; the others expected at it.
    # Every step of a configuration took the same time: the measured times stand (weight 1)
    scale = sorted(seconds[id(c)] / c.step_time for c in fits[:3])[1]
    assert (result.trial_scale, result.trial_weight, fits[3].expected) == (None, None, None)
    assert measured.trial_scale == pytest.approx(scale, rel=1e-12) and measured.trial_weight == 1.0
    assert [c.expected for c in tried] == [1.0, 2.0, 3.0]
    assert rest[0].expected == pytest.approx(rest[0].step_time * scale, rel=1e-12)
    table = measured.table()
    assert "measured ms  expected ms" in table.splitlines()[1] and "measured step 1e+03 ms" in table
    assert f"{rest[0].step_time * scale * 1e3:.1f}  not measured" in table and f"step ms x {scale:.2f}" in table
    as_dict = measured.to_dict()
    assert as_dict["candidates"][0]["measured_s"] == 1.0 and as_dict["trial_scale"] == measured.trial_scale
    assert as_dict["candidates"][3]["expected_s"] == rest[0].expected and as_dict["trial_weight"] == 1.0
    with pytest.raises(ValueError, match=r"top=0 and steps=5 take 1 or more"):
        result.measure(step_of, top=0)

    # where the allocator keeps statistics its peak is read: one over the budget is refused
    peaks = {id(fits[0]): 70_000, id(fits[1]): 79_000, id(fits[2]): 90_000}
    allocator = SimpleNamespace(reset_peak_memory_stats=lambda device: None)
    allocator.max_memory_allocated = lambda device: peaks[id(calls[-1])]
    with fake_allocator(allocator):
        measured = result.measure(step_of, top=3)
        assert [c.measured_peak for c in measured.candidates[:3]] == [79_000, 70_000, 90_000]
        assert measured.best.measured == 2.0
        assert measured.candidates[2].lost == "memory: measured 87.89 KiB, over the budget"
        assert "peak 77.15 KiB per rank (the allocator's)" in measured.table()
        # out of memory while running one: refused, its memory freed, the others measured
        peaks[id(fits[2])] = 60_000
        alive = []

        def failing(c):
            model = torch.nn.Linear(2, 2)
            alive.append(weakref.ref(model))
            if c is fits[2]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            inner = step_of(c)
            return lambda: (model, inner())  # the step holds its model, as a trainer's does

        measured = result.measure(failing, top=3)
        assert measured.best.measured == 2.0 and [c.measured for c in measured.candidates[:3]] == [2.0, 3.0, None]
        assert measured.candidates[2].lost.startswith("memory: out of memory when run (CUDA out of memory.")
        assert all(ref() is None for ref in alive)
        peaks.update(dict.fromkeys(peaks, 100_000))
        with pytest.raises(
            memfit.PlanError,
            match=r"ran out of memory or measured over the budget of 78.12 KiB",
        ):
            result.measure(step_of, top=3)
    monkeypatch.undo()  # this process alone: 1 rank, not the W searched
    with pytest.raises(ValueError, match=r"the search is for world size 8, but this runs on 1"):
        result.measure(step_of, top=3)


def test_the_trials_weigh_their_measured_steps_against_the_scaled_price():
    from memfit._plan._trial import _scale_and_weight

    runs = [(102.0, 97.0), (95.0, 105.0), (107.0, 108.0), (118.0, 110.0)]  # (measured, priced) ms
    scale, weight = _scale_and_weight(runs, spread=0.01, steps=5)
    assert scale == pytest.approx((107 / 108 + 102 / 97) / 2)  # the median of the four ratios
    noise = math.pi / 2 * 0.01 / 5  # a median of 5 steps whose variance is 1% of the median squared
    # the scaled price's miss, noise included, over 3 degrees of freedom (the scale is fitted to the 4)
    scatter = sum((m / (scale * p) - 1) ** 2 for m, p in runs) / 3
    assert weight == pytest.approx((scatter - noise) / scatter)  # (scatter - noise) / ((scatter - noise) + noise)
    assert weight == pytest.approx(0.4557, abs=1e-4)  # by hand: scatter 0.005773, noise 0.003142
    assert _scale_and_weight(runs, spread=0.0, steps=5) == (scale, 1.0)  # steps that did not vary stand
    assert _scale_and_weight(runs, spread=0.1, steps=5) == (scale, 0.0)  # all the miss is noise: the price
    assert _scale_and_weight([(2.0, 1.0)], spread=0.01, steps=5) == (2.0, 1.0)  # one run: measured, its own scale


@pytest.mark.parametrize("swing", [0.2, 0.005])
def test_trials_keep_the_priced_order_within_their_noise_and_the_measured_beyond(monkeypatch, swing):
    from memfit._plan import _trial

    result = search(budget=80_000)
    fits = [c for c in result.candidates if c.fits]
    assert fits[0].step_time < fits[1].step_time
    clock, count = [0.0], {}
    monkeypatch.setattr(_trial, "_clock", lambda: clock[0])
    monkeypatch.setattr(_trial, "_ranks", lambda group: W)
    # the second predicted measures 5% faster than the first, each step +-swing about its median
    median = {id(fits[0]): 1.5 * fits[0].step_time, id(fits[1]): 1.5 * 0.95 * fits[0].step_time}
    wobble = [1.0, 1.0, 1 - swing, 1 + swing, 1.0, 1 - swing, 1 + swing]  # warm-up 2, then 5 timed: median 1

    def step_of(c):
        def step():
            k = count[id(c)] = count.get(id(c), -1) + 1
            clock[0] += median[id(c)] * wobble[k]

        return step

    measured = result.measure(step_of, top=2, steps=5, warmup=2)
    first, second = sorted(measured.candidates[:2], key=lambda c: c.step_time)
    assert second.measured == pytest.approx(0.95 * first.measured)
    scale, weight = _trial._scale_and_weight(
        [(c.measured, c.step_time) for c in (first, second)], swing**2, 5
    )  # the steps' variance over their median squared: 4 of 5 off by swing, 4 degrees of freedom
    assert (measured.trial_scale, measured.trial_weight) == (pytest.approx(scale), pytest.approx(weight))
    assert first.expected == pytest.approx(weight * first.measured + (1 - weight) * scale * first.step_time)
    if swing == 0.2:  # a 5% gap within steps 20% apart: the priced order decides
        assert weight < 0.5 and measured.best.step_time == first.step_time
    else:  # steps 0.5% apart: the measured gap decides
        assert weight > 0.9 and measured.best.step_time == second.step_time


def test_measure_compares_tokens_per_second_across_global_batches(monkeypatch):
    from memfit._plan import _trial

    free = Search(10**6, 1, None, FAKE, OPT, tokens=128).run(profile_of, SIZES, [Layout(1)])
    fits = [c for c in free.candidates if c.fits]
    assert len({c.micro_batch for c in fits}) >= 3 and {c.accumulation for c in fits} == {1}
    clock = [0.0]
    monkeypatch.setattr(_trial, "_clock", lambda: clock[0])

    def step_of(c):  # 1 s plus 0.1 s a sample: the largest micro-batch has the most samples a second
        def step():
            clock[0] += 1.0 + 0.1 * c.micro_batch

        return step

    measured = free.measure(step_of, top=3)
    tried = measured.candidates[:3]
    rates = [c.micro_batch / c.measured for c in tried]
    assert rates == sorted(rates, reverse=True) and tried[0].micro_batch == max(c.micro_batch for c in fits[:3])


def test_the_search_reports_each_size_and_how_many_layouts_fit():
    lines: list[str] = []
    s = Search(50_000, W, 64, FAKE, OPT, tokens=128)
    result = s.run(profile_of, SIZES, LAYOUTS, progress=lines.append)
    n, k = len(SIZES), len(LAYOUTS)
    fits = {b: sum(c.fits for c in result.candidates if c.micro_batch == b) for b in (1, 2, 4)}
    assert lines == [
        line
        for i, b in enumerate([1, 2, 4])
        for line in (
            f"micro-batch {b} ({i + 1} of at most {n} sizes): profiling on fake tensors",
            f"micro-batch {b} ({i + 1} of at most {n} sizes): {fits[b]} of {k} layouts fit "
            f"({k * (i + 1)} configurations priced so far)",
        )
    ]
    assert fits[4] == 0 and fits[1] > 0  # the last size profiled fits none: the search stops there
