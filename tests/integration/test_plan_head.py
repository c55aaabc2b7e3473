"""The LM head and loss as a planner decision: the chunked forward equals the plain loss, saves
the logits when measured, and the planner chooses it when a budget needs it."""

import copy

import pytest
import torch

import memfit
from memfit.models import Preset, Shape, lm_batch, mlm_batch

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 2, "dropout": 0.0}


def _model(arch, vocab=512, **sizes):
    preset = Preset(arch, Shape(vocab=vocab, **{**SMALL, **sizes}))
    return preset.build(), (mlm_batch if arch == "bert" else lm_batch)(preset.shape)


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])  # masked, causal with tied embeddings, causal
def test_chunked_head_has_the_plain_loss_and_gradients(arch):
    model, batch = _model(arch)
    probe = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    assert probe.profile.head is not None and probe.head == "plain"  # everything fits: no extra time
    plain, chunked = copy.deepcopy(model), copy.deepcopy(model)
    memfit.Plan.fixed(dict.fromkeys(probe.decisions, "keep"), probe.profile, head="chunked").apply(chunked)
    a, b = plain(**batch).loss, chunked(**batch).loss
    a.backward()
    b.backward()
    # Same arithmetic in a different order (chunks of rows; the logsumexp kept): float rounding.
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_head_saves_the_logits_as_forecast():
    model, batch = _model("bert", vocab=8192, seq=128, batch=4)  # logits 512 x 8192 x 4 B = 16 MiB each
    probe = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    full = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile)
    chunked = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile, head="chunked")
    plain_peak, chunked_peak = full.measure(model, batch), chunked.measure(model, batch)
    logits = batch["input_ids"].numel() * 8192 * 4
    assert plain_peak - chunked_peak >= logits  # at least one full copy of the logits never exists
    assert chunked_peak <= chunked.predicted_peak <= 1.02 * chunked_peak
    assert chunked.predicted_overhead > full.predicted_overhead  # the head's matmul runs again


def test_the_planner_chunks_the_head_only_when_a_budget_needs_it():
    model, batch = _model("bert", vocab=8192, seq=128, batch=4)
    probe = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    chunked_full = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile, head="chunked")
    plain_full = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile)
    assert chunked_full.predicted_peak < plain_full.predicted_peak
    budget = chunked_full.predicted_peak + 1024  # below every plan with the plain head
    plan = memfit.plan(model, batch, budget=budget, profile=probe.profile)
    assert plan.head == "chunked" and plan.predicted_peak <= budget
    assert "head and loss: chunked (memfit.chunked_cross_entropy)" in plan.table()
    assert plan.to_dict()["head"] == "chunked"
    with pytest.raises(memfit.PlanError, match="no plan fits"):
        memfit.plan(model, batch, budget=budget, profile=probe.profile, chunk_head=False)
    with pytest.raises(ValueError, match="chunk_head=True needs a transformers masked or causal LM"):
        memfit.plan(model, batch, budget="1TB", loss_fn=lambda out: out.loss, chunk_head=True, device_profile="cpu")
