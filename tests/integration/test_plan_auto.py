"""memfit.autoconfigure and `memfit plan --auto` on a tiny Llama: one process, the world size a
number (the search is on paper). What it chooses is the planner's plan on the real trace of
that micro-batch; no timings are asserted (times are priced, the same on every run)."""

import dataclasses
import json

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.models import Shape, llama_lm, lm_batch

SHAPE = Shape(layers=2, hidden=32, heads=4, seq=16, batch=2, vocab=256, dropout=0.0)


def test_the_pick_is_the_planners_plan_of_its_micro_batch():
    model, batch = llama_lm(SHAPE), lm_batch(SHAPE)
    result = memfit.autoconfigure(
        model, batch, budget="1GB", world_size=2, global_batch=4, decisions=("keep", "full"), chunk_head=False
    )
    assert {(c.micro_batch, c.accumulation) for c in result.candidates} == {(1, 2), (2, 1)}
    assert {c.layout.describe() for c in result.candidates} == {
        "replicated x2",
        "full shard",
        "full shard, no reshard",
    }
    assert result.tokens_per_second == pytest.approx(4 * SHAPE.seq / result.step_time)
    best = result.best
    again = memfit.plan(
        model,
        lm_batch(dataclasses.replace(SHAPE, batch=best.micro_batch)),
        budget="1GB",
        world_size=2,
        shard_size=best.layout.shard_size,
        decisions=("keep", "full"),
        chunk_head=False,
    )
    if best.layout.reshard_after_forward and best.accumulation == 1:  # as memfit.plan forecasts it
        assert again.decisions == result.plan.decisions and again.predicted_peak == best.peak
    assert result.plan.profile.step_time == again.profile.step_time  # the same trace, priced the same
    assert "chosen: micro-batch" in str(result) and json.dumps(result.to_dict())


def test_plan_auto_prints_the_table_and_the_chosen_plan(capsys, tmp_path):
    out = tmp_path / "auto.json"
    argv = ["plan", "--model", "llama", "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2"]
    argv += ["--auto", "--world-size", "2", "--global-batch", "4", "--budget", "1GB", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "configurations for world size 2, global batch 4" in text and "chosen: micro-batch" in text
    assert "is the sum of:" in text  # the chosen plan's own table
    saved = json.loads(out.read_text())
    assert saved["auto"]["candidates"][0]["lost"] == "" and saved["plan"]["world_size"] == 2
    last = "run it: torchrun --nproc-per-node 2 -m memfit train --auto --model llama --layers 2 --hidden 32 --seq 16"
    assert text.splitlines()[-1] == f"{last} --budget 1GB --global-batch 4"
    assert text.splitlines()[-2].endswith("with --trials K, memfit train times the top K first")
    assert main(["plan", "--model", "llama", "--budget", "1GB", "--global-batch", "4"]) == 2  # --auto only


def test_under_mixed_precision_replicated_layouts_need_fp32_sums():
    """A replicated layout of W > 1 ranks is forecast under mixed precision where gradients are
    summed in fp32 (they accumulate in fp32 under no_sync): searched, planned as memfit.plan
    plans it. Summed in bf16 it is not forecast: autoconfigure leaves it out, memfit.plan
    refuses it by name (also given such a profile)."""
    model, batch = llama_lm(SHAPE), lm_batch(SHAPE)
    bf16 = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opts = {"decisions": ("keep", "full"), "chunk_head": False}
    result = memfit.autoconfigure(
        model, batch, budget="1GB", world_size=2, global_batch=4, mixed_precision=bf16, **opts
    )
    assert {c.layout.describe() for c in result.candidates} == {"full shard", "full shard, no reshard", "replicated x2"}
    assert result.plan.profile.master_bytes == sum(p.numel() * 4 for p in model.parameters())
    (whole,) = [c for c in result.candidates if c.layout.shard_size == 1 and c.micro_batch == SHAPE.batch]
    plan = memfit.plan(model, batch, budget="1GB", world_size=2, shard_size=1, mixed_precision=bf16, **opts)
    assert whole.accumulation == 1 and plan.predicted_peak == whole.peak
    summed_in_bf16 = memfit.MixedPrecision(param_dtype=torch.bfloat16)
    narrow = memfit.autoconfigure(
        model, batch, budget="1GB", world_size=2, global_batch=4, mixed_precision=summed_in_bf16, **opts
    )
    assert {c.layout.shard_size for c in narrow.candidates} == {2}
    with pytest.raises(
        ValueError, match=r"mixed precision over 2 replicas of one shard is forecast with reduce_dtype="
    ):
        memfit.plan(model, batch, budget="1GB", world_size=2, shard_size=1, mixed_precision=summed_in_bf16)
    with pytest.raises(ValueError, match=r"mixed precision over 2 replicas"):  # the profile says it
        memfit.plan(model, batch, budget="1GB", world_size=2, shard_size=1, profile=narrow.plan.profile)
    fp32 = memfit.plan(model, batch, budget="1GB", world_size=2).profile
    with pytest.raises(ValueError, match=r"mixed_precision= with a profile measured without it"):
        memfit.plan(model, batch, budget="1GB", world_size=2, profile=fp32, mixed_precision=bf16)
    with pytest.raises(ValueError, match=r"leaves only replicated layouts"):
        memfit.autoconfigure(model, batch, budget="1GB", world_size=2, shard_sizes=[1], mixed_precision=summed_in_bf16)
