"""The planner without a model: budgets, forecasts and the exact solver on hand-built profiles."""

import dataclasses
import itertools

import pytest
import torch

import memfit
from memfit._plan._budget import format_bytes
from memfit._plan._profile import DECISIONS
from memfit._plan._profile_types import BlockProfile, ModelProfile
from memfit._plan._solve import Sharding, forecast, smallest_budget, solve, terms
from memfit._plan._time import PROFILES


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


def with_outside(profile, seed):
    """``profile`` with the terms of [Note: Memory outside the blocks] and each block's forward
    peak, large enough to set the peak at some decisions."""
    g = torch.Generator().manual_seed(100 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    blocks = [
        dataclasses.replace(b, forward_peak={d: b.kept[d] + r(0, 5000) for d in DECISIONS}) for b in profile.blocks
    ]
    between = sorted(r(0, 3000) for _ in blocks)
    transient = [r(0, 8000) if i % 2 else 0 for i in range(len(blocks))]
    outside = {"between": between, "between_end": between[-1], "forward_transient": transient}
    return dataclasses.replace(profile, blocks=blocks, **outside)


def shared(profile):
    """``profile`` with blocks 1 and 3 calls of one module, and 2 and 4 of another ([Note: A
    module run several times]): each module takes one decision."""
    paths = ["b0", "s", "t", "s", "t"]
    return dataclasses.replace(profile, blocks=[dataclasses.replace(b, path=p) for b, p in zip(profile.blocks, paths)])


def brute_force(profile, budget):
    best = None
    paths = [b.path for b in profile.blocks]
    for ds in itertools.product(DECISIONS, repeat=len(profile.blocks)):
        if any(d != ds[paths.index(p)] for p, d in zip(paths, ds)):  # a module's calls: one decision
            continue
        f = forecast(profile, list(ds))
        if f["peak"] <= budget and (best is None or f["extra_time"] < best[0] - 1e-12):
            best = (f["extra_time"], list(ds))
    return best


@pytest.mark.parametrize("outside", [False, True, "shared"], ids=["chain", "outside", "shared"])
@pytest.mark.parametrize("seed", range(4))
def test_solver_is_optimal_on_small_chains(seed, outside):
    profile = with_outside(synthetic(5, seed), seed) if outside else synthetic(5, seed)
    profile = shared(profile) if outside == "shared" else profile
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


@pytest.mark.parametrize("seed", [0, 6, 7])
def test_infeasible_budget_names_the_smallest(seed):
    # The smallest budget is printed rounded up: rounded to nearest (seed 6: 14.66 KiB for
    # 15012 bytes) the budget the error named did not fit.
    profile = synthetic(6, seed)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(memfit.PlanError, match=r"no plan fits .*smallest budget that fits is ([0-9.]+) KiB") as e:
        memfit.plan(model, {}, budget=5_000, profile=profile)
    smallest = e.value.args[0].split("smallest budget that fits is ")[1].split(" KiB")[0]
    memfit.plan(model, {}, budget=f"{smallest} KiB", profile=profile)  # fits as printed (rounded up)


@pytest.mark.parametrize(
    ("world_size", "shard_size", "error"),
    [(0, None, ValueError), (-1, None, ValueError), (1, 4, ValueError), (2.0, None, TypeError), (4, True, TypeError)],
)
def test_bad_world_and_shard_sizes_are_refused(world_size, shard_size, error):
    # world_size 0 or -1 planned silently for one process; shard_size 4 without world_size was
    # ignored (one process, no sharding); a float or a bool was taken as a count of ranks.
    model = torch.nn.Linear(2, 2)
    with pytest.raises(error, match=r"memfit\.plan: (world|shard)_size"):
        memfit.plan(model, {}, budget="1GB", profile=synthetic(3), world_size=world_size, shard_size=shard_size)


def test_shard_size_without_sharding_is_refused():
    with pytest.raises(ValueError, match=r"memfit\.plan: shard_size=2 with sharding=False"):
        memfit.plan(
            torch.nn.Linear(2, 2), {}, budget="1GB", profile=synthetic(3), world_size=4, shard_size=2, sharding=False
        )


def test_sharded_terms_divide_state_by_world_size():
    profile = synthetic(4)
    one, four = terms(profile, None), terms(profile, Sharding(4))
    assert four["state"] == one["state"] / 4 and four["grad_rest"] == one["grad_rest"] / 4  # no buffers here
    rest = profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
    # The root's full parameters and, in backward, two blocks in flight: buffers beside the shards.
    assert four["gather_buffers"] == rest and four["unit_buffers"] == 2 * 400


def test_hybrid_sharding_divides_state_by_the_shard_group():
    # HSDP, 16 ranks as 2 replicas x 8 shards: per-rank bytes are those of full sharding over 8.
    profile = synthetic(4)
    hsdp, eight = Sharding(16, shard_size=8), Sharding(8)
    assert (hsdp.shards, hsdp.replicas) == (8, 2)
    assert terms(profile, hsdp) == terms(profile, eight)
    assert forecast(profile, ["keep"] * 4, hsdp) == forecast(profile, ["keep"] * 4, eight)
    assert solve(profile, 20_000, hsdp) == solve(profile, 20_000, eight)
    # The formula, term by term (no buffers in this profile).
    t = terms(profile, hsdp)
    assert t["state"] == profile.state_bytes / 8 and t["grad_rest"] == profile.grad_rest_bytes / 8
    assert t["optimizer_peak"] == profile.optimizer_peak / 8
    # Replicas only (shard_size 1, DDP's layout): every rank holds everything, nothing is gathered.
    assert terms(profile, Sharding(16, shard_size=1)) == terms(profile, None)
    assert Sharding(16, shard_size=16).shards == 16 and Sharding(16).replicas == 1
    for bad in (3, 0, 32):
        with pytest.raises(ValueError, match=f"shard_size {bad} must divide world_size 16"):
            Sharding(16, shard_size=bad)


# -- the memory model on a hand-built profile -------------------------------------------------
# Two blocks, b0 then b1; bytes. See [Note: The planner's memory model] for the moments.
BLOCK_PARAMS = {"b0": 400, "b1": 800}  # each block's parameters; its gradients are as large
REST_PARAMS = 1_800  # parameters outside the blocks (embeddings, head)
PARAMS = sum(BLOCK_PARAMS.values()) + REST_PARAMS  # 3_000, no buffers
OPTIMIZER = 2 * PARAMS  # AdamW's two states
S = PARAMS + OPTIMIZER  # parameters and optimizer state: 9_000
G_REST = REST_PARAMS  # gradients of the parameters outside the blocks
BEFORE = 500  # O: the batch and the embeddings' output when b0 starts
Y_LAST = 100  # b1's output
T_HEAD = 700  # head, loss and their backward above the end-of-forward state
P_OPT = 2 * PARAMS + OPTIMIZER + 1_000  # the optimizer step: parameters, gradients, state, temporaries
KEPT = {  # what each block keeps for backward, per decision (its input included unless offloaded)
    "b0": {"keep": 1_000, "selective": 600, "full": 100, "offload": 0},
    "b1": {"keep": 3_000, "selective": 1_500, "full": 100, "offload": 0},
}
B = {  # B_i: the block's own forward and backward peak, per decision
    "b0": {"keep": 2_000, "selective": 1_900, "full": 1_800, "offload": 1_800},
    "b1": {"keep": 5_000, "selective": 3_500, "full": 1_500, "offload": 1_500},
}
EXTRA = {  # seconds a decision adds to a step
    "b0": {"keep": 0.0, "selective": 0.001, "full": 0.003, "offload": 0.004},
    "b1": {"keep": 0.0, "selective": 0.002, "full": 0.006, "offload": 0.008},
}


def hand_built(**changes):
    blocks = [
        BlockProfile(name, BLOCK_PARAMS[name], BLOCK_PARAMS[name], 100, 100, KEPT[name], B[name], 0.01, EXTRA[name])
        for name in ("b0", "b1")
    ]
    profile = ModelProfile(blocks, S, PARAMS, OPTIMIZER, G_REST, BEFORE, Y_LAST, T_HEAD, P_OPT)
    return dataclasses.replace(profile, **changes)


def test_terms_are_the_profile_unsharded():
    f = forecast(hand_built(), ["keep", "keep"])
    assert f["term:state"] == S
    assert f["term:grad_rest"] == G_REST
    assert f["term:before_blocks"] == BEFORE
    assert f["term:last_output"] == Y_LAST
    assert f["term:head_transient"] == T_HEAD
    assert f["term:optimizer_peak"] == P_OPT
    assert f["term:gather_buffers"] == f["term:unit_buffers"] == 0  # nothing is gathered in one process
    assert f["kept_activations"] == KEPT["b0"]["keep"] + KEPT["b1"]["keep"]
    assert f["extra_time"] == 0.0


def test_keeping_everything_peaks_in_the_backward_of_the_last_block():
    f = forecast(hand_built(), ["keep", "keep"])
    end_of_forward = S + BEFORE + KEPT["b0"]["keep"] + KEPT["b1"]["keep"] + Y_LAST + T_HEAD  # 14_300
    backward_b0 = S + BEFORE + G_REST + BLOCK_PARAMS["b1"] + B["b0"]["keep"]  # b1's gradients exist: 14_100
    backward_b1 = S + BEFORE + G_REST + KEPT["b0"]["keep"] + B["b1"]["keep"]  # b0 still keeps its tensors: 17_300
    assert backward_b1 > max(end_of_forward, backward_b0, P_OPT)
    assert (f["at"], f["peak"]) == ("backward of b1", backward_b1)
    # The same sum read off the forecast's named terms.
    assert (
        f["peak"]
        == f["term:state"] + f["term:before_blocks"] + f["term:grad_rest"] + KEPT["b0"]["keep"] + B["b1"]["keep"]
    )


def test_checkpointing_the_last_block_moves_the_peak_to_the_first():
    f = forecast(hand_built(), ["keep", "full"])
    end_of_forward = S + BEFORE + KEPT["b0"]["keep"] + KEPT["b1"]["full"] + Y_LAST + T_HEAD  # 11_400
    backward_b1 = S + BEFORE + G_REST + KEPT["b0"]["keep"] + B["b1"]["full"]  # 13_800
    backward_b0 = S + BEFORE + G_REST + BLOCK_PARAMS["b1"] + B["b0"]["keep"]  # 14_100
    assert backward_b0 > max(end_of_forward, backward_b1, P_OPT)
    assert (f["at"], f["peak"]) == ("backward of b0", backward_b0)
    assert f["kept_activations"] == KEPT["b0"]["keep"] + KEPT["b1"]["full"]
    assert f["extra_time"] == EXTRA["b0"]["keep"] + EXTRA["b1"]["full"]


def test_a_large_head_peaks_at_the_end_of_forward():
    head = 10_000  # e.g. full logits over a large vocabulary
    f = forecast(hand_built(head_transient=head), ["keep", "keep"])
    end_of_forward = S + BEFORE + KEPT["b0"]["keep"] + KEPT["b1"]["keep"] + Y_LAST + head  # 23_600
    backward_b1 = S + BEFORE + G_REST + KEPT["b0"]["keep"] + B["b1"]["keep"]  # 17_300
    assert end_of_forward > backward_b1
    assert (f["at"], f["peak"]) == ("end of forward", end_of_forward)
    assert f["peak"] == (
        f["term:state"]
        + f["term:gather_buffers"]
        + f["term:before_blocks"]
        + f["kept_activations"]
        + f["term:last_output"]
        + f["term:head_transient"]
    )


def test_a_large_optimizer_step_peaks_there_whatever_is_decided():
    step = 30_000  # e.g. a foreach optimizer's temporaries
    for decisions in itertools.product(DECISIONS, repeat=2):
        f = forecast(hand_built(optimizer_peak=step), list(decisions))
        assert (f["at"], f["peak"]) == ("optimizer step", step)


@pytest.mark.parametrize("sharding", [None, Sharding(2)], ids=["one", "sharded"])
def test_the_allocator_workspace_is_alive_at_every_moment(sharding):
    # [Note: The allocator beside the tensors]: a CUDA profile's workspace raises every moment
    # by the same bytes, so the peak moves by it, the decisions do not, and the parts still sum.
    ws = 7_000
    for decisions in itertools.product(DECISIONS, repeat=2):
        plain = forecast(hand_built(), list(decisions), sharding)
        cuda = forecast(dataclasses.replace(hand_built(), workspace_bytes=ws), list(decisions), sharding)
        assert cuda["at"] == plain["at"] and cuda["peak"] == plain["peak"] + ws, decisions
        assert cuda["term:workspace"] == ws and cuda["part:workspace"] == ws
        assert sum(v for k, v in cuda.items() if k.startswith("part:")) == cuda["peak"]
    large_step = hand_built(optimizer_peak=60_000, workspace_bytes=ws)  # the optimizer step's moment too
    f = forecast(large_step, ["keep", "keep"], sharding)
    assert (f["at"], f["peak"]) == ("optimizer step", 60_000 / (sharding.shards if sharding else 1) + ws)
    assert PROFILES["h100"].workspace_bytes > 0 and PROFILES["cpu"].workspace_bytes == 0


def test_sharded_terms_at_two_ranks():
    profile = hand_built()
    one, two = terms(profile, None), terms(profile, Sharding(2))
    assert terms(profile, Sharding(1)) == one  # one rank: nothing sharded, nothing gathered
    assert two["state"] == S / 2  # parameters and AdamW state, half per rank (no buffers)
    assert two["grad_rest"] == G_REST / 2
    assert two["optimizer_peak"] == P_OPT / 2
    assert two["gather_buffers"] == REST_PARAMS  # the root's full parameters, a buffer beside its shard
    assert two["unit_buffers"] == 2 * BLOCK_PARAMS["b1"]  # in backward: the largest unit and the prefetched one
    for unchanged in ("before_blocks", "last_output", "head_transient"):  # activations: per rank as before
        assert two[unchanged] == one[unchanged]
    f = forecast(profile, ["keep", "keep"], Sharding(2))
    base = S / 2 + two["gather_buffers"] + BEFORE
    backward_b1 = (
        base
        + two["unit_buffers"]
        + G_REST  # the root's gradients, whole until its reduce-scatter at the end of backward
        + BLOCK_PARAMS["b1"]  # b1's own gradients, unsharded until reduce-scattered
        + KEPT["b0"]["keep"]
        + B["b1"]["keep"]
    )  # 17_000
    backward_b0 = (
        base + two["unit_buffers"] + G_REST + BLOCK_PARAMS["b1"] / 2 + BLOCK_PARAMS["b0"] + B["b0"]["keep"]
    )  # 13_000
    end_of_forward = base + KEPT["b0"]["keep"] + KEPT["b1"]["keep"] + Y_LAST + T_HEAD  # 11_600: no unit gathered
    # The root's reduce-scatter: its parameters freed; its gradients, the send buffer, the shard back,
    # and 1 KiB per unit (3 here) of the runtime's flags and check sums.
    end_of_backward = S / 2 + sum(BLOCK_PARAMS.values()) / 2 + 2 * G_REST + G_REST / 2 + 3 * 1024  # 12_672
    assert f["term:unit_buffers"] == two["unit_buffers"]
    optimizer = P_OPT / 2  # 6_500: nothing gathered
    assert forecast(profile, ["full", "full"], Sharding(2))["peak"] == max(
        base + two["unit_buffers"] + G_REST + BLOCK_PARAMS["b1"] + KEPT["b0"]["full"] + B["b1"]["full"],
        base + two["unit_buffers"] + G_REST + BLOCK_PARAMS["b1"] / 2 + BLOCK_PARAMS["b0"] + B["b0"]["full"],
        base + KEPT["b0"]["full"] + KEPT["b1"]["full"] + Y_LAST + T_HEAD,
        end_of_backward,
        optimizer,
    )
    big_rest = hand_built(grad_rest_bytes=10 * G_REST)  # e.g. a large vocabulary's embeddings and head
    assert forecast(big_rest, ["full", "full"], Sharding(2))["at"] == "end of backward"
    assert backward_b1 > max(backward_b0, end_of_forward, end_of_backward, optimizer)
    assert (f["at"], f["peak"]) == ("backward of b1", backward_b1)
    assert f["peak"] < forecast(profile, ["keep", "keep"])["peak"]


def test_buffers_are_replicated_when_sharded():
    buffers = 1_000
    profile = hand_built(state_bytes=S + buffers, param_bytes=PARAMS + buffers, buffer_bytes=buffers)
    assert terms(profile, Sharding(4))["state"] == S / 4 + buffers  # every rank holds every buffer
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        Sharding(0)


def test_solve_respects_the_budget():
    profile = hand_built()
    assert solve(profile, 10**9) == ["keep", "keep"]  # everything fits: no extra time
    # Exactly the backward moment of b0 under keep: b0 may keep, b1 must drop to full or
    # offload (its backward needs S + BEFORE + G_REST + kept_0 + B_1 <= budget), and full is cheaper.
    budget = S + BEFORE + G_REST + BLOCK_PARAMS["b1"] + B["b0"]["keep"]  # 14_100
    assert solve(profile, budget) == ["keep", "full"]
    for budget in range(13_900, 18_000, 50):
        decisions = solve(profile, budget)
        assert decisions is not None and forecast(profile, decisions)["peak"] <= budget, budget


def test_solve_returns_none_below_the_smallest_budget():
    profile = hand_built()
    # b0's backward moment has no kept activations before it to drop: its floor is b0's
    # smallest B_0 on top of what is alive anyway. Every other moment can go lower.
    floor = S + BEFORE + G_REST + BLOCK_PARAMS["b1"] + min(B["b0"].values())  # 13_900
    assert floor == min(forecast(profile, list(ds))["peak"] for ds in itertools.product(DECISIONS, repeat=2))
    assert solve(profile, floor - 1) is None
    assert solve(profile, P_OPT - 1) is None  # below the optimizer step: nothing helps
    smallest = smallest_budget(profile)
    assert solve(profile, smallest) is not None
    # Bisection to 1/2000 of the budget, plus the solver's rounding (2 blocks x budget/8192).
    assert floor <= smallest <= floor * (1 + 1 / 2000 + 2 / 8192) + 1


def test_plan_on_a_given_profile_solves_without_measuring():
    profile = hand_built()
    budget = S + BEFORE + G_REST + BLOCK_PARAMS["b1"] + B["b0"]["keep"]  # 14_100, as above
    plan = memfit.plan(torch.nn.Linear(2, 2), {}, budget=budget, profile=profile)
    assert plan.decisions == {"b0": "keep", "b1": "full"}
    assert plan.predicted_peak == budget and plan.predicted_overhead == EXTRA["b1"]["full"]
    d = plan.to_dict()
    assert (d["budget"], d["world_size"], d["peak_at"]) == (budget, 1, "backward of b0")
    assert d["kept_activations"] == KEPT["b0"]["keep"] + KEPT["b1"]["full"]
    rows = plan.table().splitlines()
    saved_b1 = KEPT["b1"]["keep"] - KEPT["b1"]["full"]  # what b1's decision saves against keeping: 2_900 B
    extra_ms = EXTRA["b1"]["full"] * 1e3
    want = ["b1", "full", f"{KEPT['b1']['full']}", "B", f"{saved_b1 / 2**10:.2f}", "KiB", f"{extra_ms:.1f}"]
    assert rows[2].split() == want
    with pytest.raises(ValueError, match=r"unknown decisions \['fast'\]"):
        memfit.plan(torch.nn.Linear(2, 2), {}, budget=budget, profile=profile, decisions=("keep", "fast"))


def test_fixed_plan_needs_a_decision_for_every_block():
    profile = hand_built()
    with pytest.raises(ValueError, match=r"no decision for blocks \['b1'\]"):
        memfit.Plan.fixed({"b0": "keep"}, profile)
    fixed = memfit.Plan.fixed({"b0": "keep", "b1": "keep"}, profile)
    assert fixed.budget is None and "fixed strategy (no budget)" in fixed.table()
    assert fixed.predicted_peak == forecast(profile, ["keep", "keep"])["peak"]
    assert "exceeds" not in fixed.compare(fixed.predicted_peak)  # no budget to fit


def test_model_state_offload_is_forecast_per_rank():
    # See [Note: Model-state offload, forecast only]: the formula on the hand-built profile.
    from memfit._plan._solve import state_offload
    from memfit._plan._time import PROFILES

    profile = dataclasses.replace(hand_built(), offload_bandwidth=1e6)
    saved, seconds = state_offload(profile, Sharding(4))
    grads = G_REST + sum(BLOCK_PARAMS.values())  # every trainable parameter's gradient
    assert saved == (PARAMS + OPTIMIZER + grads) / 4
    host = 2 * (PARAMS + grads + OPTIMIZER) / 4 / PROFILES["cpu"].memory_bandwidth
    assert seconds == pytest.approx((2 * PARAMS + grads) / 4 / 1e6 + host)  # float64 division order
    assert saved == state_offload(profile, Sharding(8, shard_size=4))[0]  # HSDP: the shard group's
    text = memfit.Plan.fixed({"b0": "keep", "b1": "keep"}, profile, Sharding(4)).table()
    lever = next(line for line in text.splitlines() if "model state offload (memfit.shard(offload='cpu'))" in line)
    assert f"saves {format_bytes(saved)} for" in " ".join(lever.split())  # a ranked lever, priced
    assert "model state offload" not in memfit.Plan.fixed({"b0": "keep", "b1": "keep"}, profile).table()


def test_a_plan_for_another_world_size_than_calibrated_warns():
    """A profile calibrated by 2 ranks prices a 4-rank plan with compute measured while 2 ranks
    shared the machine and links between 2: the plan warns and names the command; the same
    world size, and the named (data-sheet) profiles, do not."""
    import dataclasses
    import warnings

    from memfit._plan._time import PROFILES

    two = dataclasses.replace(PROFILES["cpu"], calibrated_ranks=2)
    model, profile = torch.nn.Linear(2, 2), synthetic(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memfit.plan(model, {}, budget="1GB", profile=profile, world_size=2, device_profile=two)
        memfit.plan(model, {}, budget="1GB", profile=profile, world_size=4, device_profile="cpu")
    with pytest.warns(UserWarning, match=r"calibrated with 2 ranks.*world size 4.*memfit calibrate --world-size 4"):
        memfit.plan(model, {}, budget="1GB", profile=profile, world_size=4, device_profile=two)


def test_layerdrop_is_turned_off_by_any_name_and_a_dict_config_is_left_alone():
    """SeamlessM4T's speech_encoder_layerdrop dropped a layer while the planner profiled; a
    module whose `config` is a plain dict (no attributes) must not stop planning."""
    from types import SimpleNamespace

    from memfit._plan._profile import _layerdrop_off

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].config = SimpleNamespace(speech_encoder_layerdrop=0.1, layerdrop=0.2, dropout=0.1)
    model[1].config = {"layerdrop": 0.1}
    model[1].decoder_layerdrop = 0.3
    _layerdrop_off(model)
    assert vars(model[0].config) == {"speech_encoder_layerdrop": 0.0, "layerdrop": 0.0, "dropout": 0.1}
    assert model[1].config == {"layerdrop": 0.1} and model[1].decoder_layerdrop == 0.0
