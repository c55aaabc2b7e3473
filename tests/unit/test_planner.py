"""The planner without a model: budgets, forecasts and the exact solver on hand-built profiles."""

import itertools

import pytest
import torch

import memfit
from memfit.testing import DECISIONS, BlockProfile, ModelProfile, Sharding, forecast, solve, terms


def test_parse_bytes():
    assert memfit.parse_bytes("6GB") == 6 * 10**9
    assert memfit.parse_bytes("3.5GiB") == int(3.5 * 2**30)
    assert memfit.parse_bytes("800MB") == 800 * 10**6
    assert memfit.parse_bytes(" 512 kib ") == 512 * 1024
    assert memfit.parse_bytes(12345) == 12345
    for bad in ("6 parsecs", "GB", "-1GB", "", "1.2.3MB"):
        with pytest.raises(ValueError, match="memory budget"):
            memfit.parse_bytes(bad)
    with pytest.raises(TypeError):
        memfit.parse_bytes(True)


def synthetic(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(n):
        r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
        keep = r(800, 1200)
        kept = {"keep": keep, "selective": keep // 2 + r(0, 50), "full": r(50, 120), "offload": r(0, 20)}
        peak = {d: kept[d] + r(1500, 2500) for d in DECISIONS}
        t = r(5, 15) / 1000
        extra = {"keep": 0.0, "selective": t * 0.3, "full": t, "offload": t * 1.5}
        blocks.append(BlockProfile(f"b{i}", 400, 400, 100, 100, kept, peak, t, extra))
    return ModelProfile(blocks, 10_000, 4_000, 6_000, 500, 300, 100, 3_000, 13_000)


def brute_force(profile, budget):
    best = None
    for ds in itertools.product(DECISIONS, repeat=len(profile.blocks)):
        f = forecast(profile, list(ds))
        if f["peak"] <= budget and (best is None or f["extra_time"] < best[0] - 1e-12):
            best = (f["extra_time"], list(ds))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_solver_is_optimal_on_small_chains(seed):
    profile = synthetic(5, seed)
    keep_peak = forecast(profile, ["keep"] * 5)["peak"]
    full_peak = forecast(profile, ["offload"] * 5)["peak"]
    for frac in (0.1, 0.4, 0.7, 1.0):
        budget = int(full_peak + frac * (keep_peak - full_peak))
        got = solve(profile, budget)
        want = brute_force(profile, budget)
        if want is None:
            assert got is None
            continue
        f = forecast(profile, got)
        assert f["peak"] <= budget
        # Binning rounds kept bytes up (grain = budget / 8192), so the solver may give up a
        # plan whose peak is within n * grain of the budget: it is never worse by more.
        near = brute_force(profile, budget - 5 * budget / 8192)
        assert f["extra_time"] <= (near[0] if near else float("inf")) + 1e-12
        assert f["extra_time"] >= want[0] - 1e-12


def test_infeasible_budget_names_the_smallest():
    profile = synthetic(6)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(memfit.PlanError, match=r"no plan fits .*smallest budget that fits is ([0-9.]+) KiB") as e:
        memfit.plan(model, {}, budget=5_000, profile=profile)
    smallest = float(e.value.args[0].split("smallest budget that fits is ")[1].split(" KiB")[0]) * 1024
    memfit.plan(model, {}, budget=int(smallest) + 64, profile=profile)  # fits (to the solver's grain)


def test_sharded_terms_divide_state_by_world_size():
    profile = synthetic(4)
    one, four = terms(profile, None), terms(profile, Sharding(4))
    assert four["state"] == one["state"] / 4 and four["grad_rest"] == one["grad_rest"] / 4  # no buffers here
    rest = profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
    assert four["gather_buffers"] == 2 * 400 + rest * 3 / 4
