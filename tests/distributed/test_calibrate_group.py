"""calibrate_group's links and per-collective cost, measured in a spawned gloo group: the fits
every rank agrees on, and the collectives the time model prices for a micro-batch counted
against those memfit's sharding issues (exact: counts). The whole calibrate_group (every
rank's compute too, ~90 s at W=2) runs in benchmarks/autoconfig.py and `memfit calibrate
--world-size N`, not here; what the figures are worth is measured there, not tested."""

import math

import pytest
import torch
import torch.distributed as dist

import memfit
from memfit._plan import _comm as comm
from memfit._plan._calibrate import _Block, _collective_costs, _group_links, calibrate_links
from memfit._plan._time import PROFILES
from memfit._shard._collectives import STATS
from tests._dist import Subtests, case_id

WIDTH = 32


def case_links_are_fitted_alike_on_every_rank(rank, world):
    links = calibrate_links(repeats=2)
    assert links["ranks_per_node"] == world
    assert links["scatter_by_all_reduce"] is True  # gloo on the CPU: see memfit/_shard/_collectives.py
    assert links["intra_node_bandwidth"] > 0 and math.isfinite(links["intra_node_bandwidth"])
    assert links["intra_node_latency"] >= 0
    assert (links["inter_node_bandwidth"], links["inter_node_latency"]) == (
        links["intra_node_bandwidth"],
        links["intra_node_latency"],
    )  # one host
    every = [None] * world
    dist.all_gather_object(every, links)
    assert all(other == links for other in every), every  # fitted on the slowest rank's times


def case_a_micro_batchs_collectives_are_counted_as_priced(rank, world):
    block = sum(p.numel() * 4 for p in _Block(WIDTH).parameters())
    for reshard in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_Block(WIDTH) for _ in range(4)])
        model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={_Block}, reshard_after_forward=reshard)
        x = torch.randn(8, WIDTH)
        model(x).sum().backward()  # the first micro-batch: lazy setup
        before = STATS.all_gathers + STATS.reduce_scatters + STATS.all_reduces
        model(x).sum().backward()
        issued = STATS.all_gathers + STATS.reduce_scatters + STATS.all_reduces - before
        units = comm.Units(0.0, 0.0, [block] * 4, [block] * 4, 0.0, 0.0, [1e-3] * 4, [2e-3] * 4)
        priced = comm.micro_batch_comm(units, world, world, reshard, True, PROFILES["cpu"])
        assert priced["collectives"] == issued, (reshard, priced["collectives"], issued)


def case_every_layout_gets_its_overheads(rank, world):
    """Every layout of the group measured (4 ranks: fully sharded, hybrid 2 x 2, replicated on
    memfit's units), each pair finite, no overlap on a CPU; every rank with the same figures;
    the groups made for the hybrid layouts ended."""
    links = {"intra_node_bandwidth": 1e9, "intra_node_latency": 1e-4, "ranks_per_node": world}
    groups = set(dist.distributed_c10d._world.pg_map)  # torch's registry of this process's groups
    overlap, per_layout = _collective_costs(None, "cpu", links, widths=(WIDTH, 4 * WIDTH), rows=(8, 32), micro=1)
    left = set(dist.distributed_c10d._world.pg_map) - groups
    left_ranks = [dist.get_process_group_ranks(g) for g in left]
    assert not left, f"the hybrid layouts' groups outlived the calibration: {left_ranks}"
    assert overlap == 0.0  # a CPU's gloo threads share its cores (the fit itself: test_autoconfigure)
    assert [s for s, _, _ in per_layout] == [4, 2, 1], per_layout
    assert all(math.isfinite(a + b) for _, a, b in per_layout), per_layout  # (>= 0: the fit clamps)
    every = [None] * world
    dist.all_gather_object(every, (overlap, per_layout))
    assert all(other == (overlap, per_layout) for other in every), every  # fitted on the slowest rank's times


def case_smaller_groups_are_fitted_at_each_divisor(rank, world):
    sizes = _group_links(None, torch.device("cpu"))  # 4 ranks: the 2-rank groups a hybrid 2 x 2 runs in
    assert [g for g, _, _ in sizes] == [2], sizes
    ((_, latency, bandwidth),) = sizes
    assert latency >= 0 and 0 < bandwidth and math.isfinite(bandwidth)
    dist.barrier()  # the subgroups are gone; the default group still works
    assert calibrate_links(repeats=1)["ranks_per_node"] == world


CASES = [case_links_are_fitted_alike_on_every_rank, case_a_micro_batchs_collectives_are_counted_as_priced]
GROUP = Subtests(CASES)
CASES_OF_4 = [case_smaller_groups_are_fitted_at_each_divisor, case_every_layout_gets_its_overheads]
GROUP_OF_4 = Subtests(CASES_OF_4)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_calibrate_group(case):
    GROUP.check(case, 2)


@pytest.mark.parametrize("case", CASES_OF_4, ids=case_id)
def test_calibrate_group_of_four(case):
    GROUP_OF_4.check(case, 4)
