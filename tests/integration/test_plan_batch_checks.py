"""memfit.plan refuses a batch the real step would refuse (See [Note: Checking the batch before
planning]): sequences longer than the learned positions, token ids or labels outside the
vocabulary, ids that are not an integer [batch, seq] tensor. Each case first shows the real
step fails on it (so the check is not stricter than the model), then that the planner names
the argument and the limit. HF GPT-2 and BERT, tiny configs, one process."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

import memfit


def gpt2():
    config = GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def bert():
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(config)


def ids(*shape, value=1, dtype=torch.long):
    return torch.full(shape, value, dtype=dtype)


CASES = [
    # (model, batch, the error's words)
    (
        gpt2,
        {"input_ids": ids(2, 128), "labels": ids(2, 128)},
        r"\['input_ids'\] has 128 positions .* learned 64 "
        r"\(config\.max_position_embeddings\)",
    ),
    (
        bert,
        {"input_ids": ids(2, 65), "labels": ids(2, 65)},
        r"\['input_ids'\] has 65 positions .* learned 64 "
        r"\(config\.max_position_embeddings\)",
    ),
    (
        gpt2,
        {"input_ids": ids(2, 16, value=100), "labels": ids(2, 16)},
        r"\['input_ids'\] holds 100, but the model's "
        r"vocabulary size is 100: every value must be in \[0, 100\)",
    ),
    (
        bert,
        {"input_ids": ids(2, 16, value=-1), "labels": ids(2, 16)},
        r"\['input_ids'\] holds -1, .* vocabulary size "
        r"is 100",
    ),
    (
        gpt2,
        {"input_ids": ids(2, 16), "labels": ids(2, 16, value=150)},
        r"\['labels'\] holds 150, .* in \[0, 100\) "
        r"or -100 \(ignored\)",
    ),
    (
        bert,
        {"input_ids": ids(2, 16), "token_type_ids": ids(2, 16, value=2)},
        r"\['token_type_ids'\] holds 2, but the "
        r"model's config\.type_vocab_size is 2",
    ),
    (
        gpt2,
        {"input_ids": ids(2, 16, dtype=torch.float32), "labels": ids(2, 16)},
        r"\['input_ids'\] holds token ids "
        r"and must be an integer tensor \(torch\.long\), got torch\.float32",
    ),
    (
        bert,
        {"input_ids": ids(16), "labels": ids(16)},
        r"\['input_ids'\] must be \[batch, seq\] token ids, got shape "
        r"\[16\]",
    ),
]


@pytest.mark.parametrize(("make", "batch", "words"), CASES)
def test_a_batch_the_step_refuses_is_refused_before_planning(make, batch, words):
    model = make()
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        model(**batch)  # the real step fails on it
    with pytest.raises(ValueError, match=r"^memfit\.plan: example_inputs" + words):
        memfit.plan(model, batch, budget="1GB")


def test_batches_at_the_limits_plan_and_ignored_labels_pass():
    model = gpt2()
    labels = ids(2, 64, value=99)
    labels[:, :5] = -100  # ignored positions
    batch = {"input_ids": ids(2, 64, value=99), "labels": labels}
    model(**batch)  # the real step runs it
    assert memfit.plan(model, batch, budget="1GB").predicted_peak > 0
    # A tensor batch is the token ids of a transformers model; on the meta device the model
    # still says its positions (values are not read from meta tensors).
    with torch.device("meta"):
        meta = gpt2()
    with pytest.raises(ValueError, match=r"example_inputs \(the token ids\) has 65 positions"):
        memfit.plan(meta, ids(2, 65), budget="1GB")
