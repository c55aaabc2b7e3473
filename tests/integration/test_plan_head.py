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
        # gradients sum over the rows of each chunk then over chunks: more terms reordered
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("Gemma2ForCausalLM", {"final_logit_softcapping": 30.0}),  # logits = cap * tanh(logits / cap)
        ("CohereForCausalLM", {"logit_scale": 0.5}),  # logits scaled after the projection
        ("MixtralForCausalLM", {"output_router_logits": True}),  # a router loss added to the loss
    ],
)
def test_a_head_the_chunked_loss_would_change_stays_plain(name, config):
    # [Note: A head the chunked loss computes exactly]: each of these has an nn.Linear output
    # embedding under a base model, as Llama does, and find_head finds it.
    import transformers

    from memfit._plan._head import find_head

    cfg = transformers.AutoConfig.for_model(
        getattr(transformers, name).config_class.model_type,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        **config,
    )
    model = getattr(transformers, name)(cfg).train()
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    assert find_head(model) is not None
    plan = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    assert plan.profile.head is None and plan.head == "plain"
    # (the heads of BERT, GPT-2 and Llama are chunked: test_chunked_head_has_the_plain_loss_and_gradients)


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


def _chunked(model, batch):
    probe = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    return memfit.Plan.fixed(dict.fromkeys(probe.decisions, "keep"), probe.profile, head="chunked")


def test_chunked_model_copies_pickles_and_indexes_as_a_model_output():
    import pickle

    model, batch = _model("gpt2")
    chunked = _chunked(model, batch).apply(copy.deepcopy(model))
    twin = copy.deepcopy(chunked)  # the closure forward computed with the original's modules
    with torch.no_grad():
        twin.transformer.wte.weight.zero_()  # tied: the logits are all zero, the loss log(V)
    # zero logits: logsumexp of 512 zeros against log(512), fp32 rounding apart (default tolerance)
    torch.testing.assert_close(twin(**batch).loss, torch.log(torch.tensor(512.0)))
    assert chunked(**batch).loss > 0 and not torch.equal(chunked(**batch).loss, twin(**batch).loss)
    out = pickle.loads(pickle.dumps(chunked))(**batch)
    assert torch.equal(out[0], out["loss"]) and torch.equal(out.loss, chunked(**batch).loss)


def test_unapply_gives_the_plain_model_back():
    model, batch = _model("gpt2")
    plain = model(**batch)
    plan = _chunked(model, batch)
    plan.apply(model)
    assert model(**batch).logits is None
    plan.unapply(model)
    back = model(**batch)
    torch.testing.assert_close(back.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(back.loss, plain.loss, rtol=0, atol=0)


def test_chunked_model_trains_under_the_hf_trainer_as_the_plain_one(tmp_path):
    # The Trainer keeps the columns the forward's signature names (a bare (*args, labels, **kwargs)
    # lost input_ids), indexes the output (outputs[0]) and, with gradient accumulation, passes
    # num_items_in_batch (the loss is then a sum over that many tokens). SGD: Adam's normalised
    # update would turn the rounding of near-zero gradients into whole steps.
    from transformers import Trainer, TrainingArguments

    model, batch = _model("gpt2")
    plan = _chunked(model, batch)
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    trained = []
    for m in (copy.deepcopy(model), plan.apply(copy.deepcopy(model))):
        args = TrainingArguments(
            str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, report_to=[],
            use_cpu=True, save_strategy="no", optim="sgd", learning_rate=1.0, dataloader_num_workers=0,
        )  # fmt: skip
        Trainer(model=m, args=args, train_dataset=data).train()
        trained.append(m)
    for (name, p), q in zip(trained[0].named_parameters(), trained[1].parameters()):
        # 2 SGD steps at lr 1.0 carry the gradients' chunk-order rounding into the parameters
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
