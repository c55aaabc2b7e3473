"""Sharded forecasts against measured sharded steps: the per-rank peak of a step under a plan,
at world sizes 2 and 4 on gloo, for small and large vocabularies and tied embeddings; under
bf16 mixed precision (fp32 shards and optimizer state) at world sizes 1, 2 and 4."""

import pytest
import torch

import memfit
from memfit._plan._autoconfig import Layout, held_gradients
from memfit._plan._validate import measured_sharded_peak
from memfit.models import Preset, Shape, lm_batch, mlm_batch
from tests._dist import Subtests, case_id

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 2, "dropout": 0.0}
MODELS = {
    "llama_8k": Preset("llama", Shape(vocab=8192, **SMALL)),
    "llama_32k": Preset("llama", Shape(vocab=32000, **SMALL)),
    "bert": Preset("bert", Shape(vocab=8192, **SMALL)),
    "gpt2_tied": Preset("gpt2", Shape(vocab=8192, **SMALL)),
}
# Measured (benchmarks/results/planner.md): every forecast at or above the measured peak, within
# 3% of it, over these models at W = 2 and 4.
TOLERANCE = 0.03


# FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), `memfit train --mixed-precision bf16`.
# Measured: forecasts 1.0000x to 1.0027x the measured peak over these models at W = 1, 2 and 4.
BF16 = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _check(name, rank, world, mixed=None):
    preset = MODELS[name]
    model = preset.build()
    batch = (mlm_batch if preset.arch == "bert" else lm_batch)(preset.shape, seed=rank)
    probe = memfit.plan(model, batch, budget="1TB", world_size=world, device_profile="cpu", mixed_precision=mixed)
    for kind in ("keep", "full"):
        plan = memfit.Plan.fixed(dict.fromkeys(probe.decisions, kind), probe.profile, probe.sharding)
        measured = measured_sharded_peak(plan, model, batch, preset.layer_class(), mixed_precision=mixed)
        # A forecast at or above the measured peak: a plan that fits its forecast fits its budget.
        # The measured peak is the same in every run (See [Note: Reduce-scatter on gloo]).
        assert measured <= plan.predicted_peak <= (1 + TOLERANCE) * measured, (
            f"{name} {kind} W={world}: {plan.compare(measured)}"
        )
    # A plan solved for a budget between the two fits it when trained sharded (where the
    # decisions move the peak: BERT's under bf16 is the root's reduce, the same for both).
    full = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile, probe.sharding).predicted_peak
    if full == probe.predicted_peak:
        return
    budget = int(full + 0.5 * (probe.predicted_peak - full))
    plan = memfit.plan(model, batch, budget=budget, world_size=world, profile=probe.profile)
    measured = measured_sharded_peak(plan, model, batch, preset.layer_class(), mixed_precision=mixed)
    assert measured <= budget, plan.compare(measured)


def case_llama_8k(rank, world):
    _check("llama_8k", rank, world)


def case_llama_32k(rank, world):
    _check("llama_32k", rank, world)


def case_bert(rank, world):
    _check("bert", rank, world)


def case_gpt2_tied(rank, world):
    _check("gpt2_tied", rank, world)


def case_llama_8k_bf16_accumulating_with_an_unused_parameter(rank, world):
    """Two micro-batches a step (the root's shard of the first alive at the second's reduce),
    and a trainable parameter the step never uses (its zero rows in the root's reduce): the
    forecast held them (before: 0.89x and 0.78x the measured peak at W = 2)."""
    preset = MODELS["llama_8k"]
    model = preset.build()
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(4096, 64)))
    batch = lm_batch(preset.shape, seed=rank)
    probe = memfit.plan(model, batch, budget="1TB", world_size=world, device_profile="cpu", mixed_precision=BF16)
    held = held_gradients(probe.profile, Layout(world, world), 2)
    for kind in ("keep", "full"):
        plan = memfit.Plan.fixed(dict.fromkeys(probe.decisions, kind), held, probe.sharding)
        measured = measured_sharded_peak(plan, model, batch, preset.layer_class(), mixed_precision=BF16, accumulate=2)
        assert measured <= plan.predicted_peak <= (1 + TOLERANCE) * measured, (
            f"{kind} W={world}: {plan.compare(measured)}"
        )


def case_llama_8k_bf16(rank, world):
    _check("llama_8k", rank, world, BF16)


def case_bert_bf16(rank, world):
    _check("bert", rank, world, BF16)


def case_gpt2_tied_bf16(rank, world):
    _check("gpt2_tied", rank, world, BF16)


CASES = [case_llama_8k, case_llama_32k, case_bert, case_gpt2_tied]
GROUP = Subtests(CASES, timeout=600.0)
MIXED = [
    case_llama_8k_bf16,
    case_bert_bf16,
    case_gpt2_tied_bf16,
    case_llama_8k_bf16_accumulating_with_an_unused_parameter,
]
MIXED_GROUP = Subtests(MIXED, timeout=600.0)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sharded_forecast_holds(world, case):
    torch.set_num_threads(1)
    GROUP.check(case, world)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", MIXED, ids=case_id)
def test_mixed_precision_forecast_holds(world, case):
    torch.set_num_threads(1)
    MIXED_GROUP.check(case, world)
