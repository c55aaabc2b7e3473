"""The planner without the memory: fake tensors, the meta device, identical blocks profiled
once, deterministic plans, and the layers found in flat Sequentials and encoder-decoders."""

import pytest
import torch
from torch import nn

import memfit
from memfit.models import Shape, llama_lm, lm_batch

SHAPE = Shape(layers=3, hidden=64, heads=4, seq=32, batch=2, vocab=512, dropout=0.0)


class Block(nn.Module):
    def __init__(self, width=32, norm=nn.LayerNorm) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = norm(width)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


def test_a_model_on_the_meta_device_plans_as_the_real_one():
    real = llama_lm(SHAPE)
    with torch.device("meta"):
        meta = llama_lm(SHAPE)
    batch = lm_batch(SHAPE)
    a = memfit.plan(real, batch, budget="1GB", device_profile="cpu")
    b = memfit.plan(meta, {k: v.to("meta") for k, v in batch.items()}, budget="1GB", device_profile="cpu")
    assert a.forecast == b.forecast and a.decisions == b.decisions
    assert all(p.device.type == "meta" for p in meta.parameters())  # not materialised


def test_same_plan_twice_and_identical_blocks_profiled_once():
    model, batch = llama_lm(SHAPE), lm_batch(SHAPE)
    first = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    assert first.profile.distinct_blocks == 1  # three identical decoder layers
    keep = first.forecast["peak"]
    full = memfit.Plan.fixed(dict.fromkeys(first.decisions, "full"), first.profile).predicted_peak
    for budget in (keep, (keep + full) // 2, full + 1):
        one = memfit.plan(model, batch, budget=int(budget), device_profile="cpu")
        two = memfit.plan(model, batch, budget=int(budget), device_profile="cpu")
        assert one.decisions == two.decisions and one.forecast == two.forecast
    # Priced, so every extra time is >= 0 and ordered: keep < selective < full < offload.
    t = first.profile.blocks[0].extra_time
    assert 0 == t["keep"] < t["selective"] < t["full"] < t["offload"]
    big = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
    assert set(big.decisions.values()) == {"keep"}


def test_the_planner_holds_no_tensor_memory_of_its_own():
    # [Note: Planning on fake tensors]: the planner's tensor storage peak is 0 bytes beyond the
    # caller's batch, within the bound max_i B_i (the largest block's working set).
    model, batch = llama_lm(SHAPE), lm_batch(SHAPE)
    with memfit.MemoryMeter() as meter:
        plan = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    largest_block_working_set = max(max(b.peak.values()) for b in plan.profile.blocks)
    assert meter.peak_bytes <= largest_block_working_set
    assert meter.peak_bytes < 1024  # AdamW's 4-byte step counters: real constants under fake mode


def test_decisions_limit_what_is_profiled_and_batchnorm_blocks_plan():
    model = nn.Sequential(*[Block(norm=nn.BatchNorm1d) for _ in range(3)])
    x = torch.randn(8, 32)
    plan = memfit.plan(model, x, budget="1GB", loss_fn=lambda y: y.sum(), decisions=("keep", "full"))
    assert {d for b in plan.profile.blocks for d in b.kept} == {"keep", "full"}
    every = memfit.plan(model, x, budget="1GB", loss_fn=lambda y: y.sum())
    selective = memfit.Plan.fixed(dict.fromkeys(every.decisions, "selective"), every.profile)
    selective.apply(model)
    model(x).sum().backward()  # BatchNorm inside a selective block trains


def test_flat_sequential_finds_the_blocks_between_stem_and_head():
    model = nn.Sequential(nn.Linear(8, 32), *[Block() for _ in range(4)], nn.Linear(32, 2))
    plan = memfit.plan(model, torch.randn(4, 8), budget="1GB", loss_fn=lambda y: y.sum())
    assert list(plan.decisions) == ["1", "2", "3", "4"]


def test_encoder_decoder_plans_both_stacks():
    from transformers import T5Config, T5ForConditionalGeneration

    sizes = {"vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}
    cfg = T5Config(**sizes, num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, 128, (2, 16))
    plan = memfit.plan(model, {"input_ids": ids, "labels": ids}, budget="1GB")
    assert list(plan.decisions) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


def test_no_repeated_blocks_names_what_to_pass():
    with pytest.raises(ValueError, match=r"pass candidates=\[\.\.\.\] with the module paths"):
        memfit.plan(nn.Linear(4, 4), torch.randn(2, 4), budget="1GB", loss_fn=lambda y: y.sum())
