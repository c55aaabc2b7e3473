"""torch FSDP's and FairScale's spellings of FullyShardedDataParallel's arguments, with torch's
own policy and mixed-precision objects. One group of 2 ranks runs every case."""

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import memfit
import memfit.testing
from tests._dist import Subtests, case_id
from tests._models import AttnBlock, make_model


def unit_names(model):
    model(torch.randint(0, 37, (2, 8)))  # the root names its units at the first forward
    return sorted(u.name for u in memfit.testing.sharded_units(model))


def one_step_loss(model):
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.reshape(-1, 37), ids.reshape(-1))
    loss.backward()
    return loss.item()


def case_torch_wrap_policies_pick_the_same_units(rank, world):
    want = unit_names(memfit.FullyShardedDataParallel(make_model("lm"), auto_wrap_policy=AttnBlock))
    assert want == ["<root TinyLM>", "blocks.0", "blocks.1"]
    policies = [
        ModuleWrapPolicy({AttnBlock}),
        CustomPolicy(lambda m: isinstance(m, AttnBlock)),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={AttnBlock}),
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, AttnBlock)),
        # An AttnBlock has 3,152 parameters, the embedding 592: only the blocks are that big.
        functools.partial(size_based_auto_wrap_policy, min_num_params=3000),
    ]
    for policy in policies:
        model = memfit.FullyShardedDataParallel(make_model("lm"), auto_wrap_policy=policy)
        assert unit_names(model) == want, policy


def case_torch_mixed_precision(rank, world):
    mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = memfit.FullyShardedDataParallel(make_model("lm"), auto_wrap_policy=AttnBlock, mixed_precision=mp)
    ours = memfit.FullyShardedDataParallel(
        make_model("lm"),
        auto_wrap_policy=AttnBlock,
        mixed_precision=memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
    )
    assert one_step_loss(model) == one_step_loss(ours)
    for (n, p), (_, q) in zip(model.named_parameters(), ours.named_parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.grad, q.grad), n
    for u in memfit.testing.sharded_units(model):
        assert u.reduce_dtype == torch.float32 and u.input_dtype == torch.bfloat16


def case_sharding_strategy(rank, world):
    for strategy, reshard in [
        (ShardingStrategy.FULL_SHARD, True),
        (ShardingStrategy.SHARD_GRAD_OP, False),
        (ShardingStrategy.NO_SHARD, False),
        ("SHARD_GRAD_OP", False),
    ]:
        model = memfit.FullyShardedDataParallel(
            make_model("lm"), auto_wrap_policy=AttnBlock, sharding_strategy=strategy
        )
        assert {u.reshard_after_forward for u in memfit.testing.sharded_units(model)} == {reshard}, strategy
    ref = memfit.FullyShardedDataParallel(make_model("lm"), auto_wrap_policy=AttnBlock)
    zero2 = memfit.FullyShardedDataParallel(
        make_model("lm"), auto_wrap_policy=AttnBlock, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
    )
    assert one_step_loss(ref) == one_step_loss(zero2)
    with pytest.raises(ValueError, match=r"HYBRID_SHARD takes process_group=\(shard_group, replicate_group\)"):
        memfit.FullyShardedDataParallel(
            make_model("lm"), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=dist.group.WORLD
        )
    local = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE .* is not set"):
            memfit.FullyShardedDataParallel(make_model("lm"), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        if local is not None:
            os.environ["LOCAL_WORLD_SIZE"] = local
    with pytest.raises(ValueError, match="pass one of them"):
        memfit.FullyShardedDataParallel(make_model("lm"), sharding_strategy="FULL_SHARD", reshard_after_forward=False)
    with pytest.raises(ValueError, match="pass one of them"):
        memfit.FullyShardedDataParallel(make_model("lm"), sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=1)
    with pytest.raises(ValueError, match="pass one of them"):  # 1 keeps everything: not FULL_SHARD
        memfit.FullyShardedDataParallel(make_model("lm"), sharding_strategy="FULL_SHARD", reshard_after_forward=1)
    if world % 2 == 0:  # FULL_SHARD, keeping 1/2 of the parameters after forward (FSDP2's int)
        kw = {"sharding_strategy": "FULL_SHARD", "reshard_after_forward": 2}
        partial = memfit.FullyShardedDataParallel(make_model("lm"), **kw)
        groups = [u.post_forward_group for u in memfit.testing.sharded_units(partial)]
        assert groups and all(dist.get_world_size(g) == 2 for g in groups)


def case_torch_keywords(rank, world):
    model = memfit.FullyShardedDataParallel(
        make_model("lm"),
        auto_wrap_policy=ModuleWrapPolicy({AttnBlock}),
        process_group=dist.group.WORLD,
        device_id=torch.device("cpu"),
        use_orig_params=False,
        cpu_offload=CPUOffload(offload_params=True),
        sync_module_states=True,
    )
    assert all(u.params[0].sharded.device.type == "cpu" for u in memfit.testing.sharded_units(model))
    one_step_loss(model)
    with pytest.raises(ValueError, match="names an accelerator"):
        if torch.accelerator.current_accelerator() is not None:
            raise ValueError("names an accelerator (skipped: this machine has one)")
        memfit.FullyShardedDataParallel(make_model("lm"), device_id=0)


def case_fairscale_keywords(rank, world):
    model = memfit.FullyShardedDataParallel(
        make_model("lm"), reshard_after_forward=False, mixed_precision=True, flatten_parameters=True
    )
    (unit,) = memfit.testing.sharded_units(model)
    assert not unit.reshard_after_forward and unit.input_dtype == torch.float16
    assert {sp.sharded.dtype for sp in unit.params} == {torch.float32}


def unit_config(model):
    """What sharding made of ``model``: per unit its name, resharding, dtypes and shard devices."""
    unit_names(model)
    return [
        (
            u.name,
            u.reshard_after_forward,
            u.input_dtype,
            u.reduce_dtype,
            sorted({str(sp.sharded.device) for sp in u.params}),
        )
        for u in memfit.testing.sharded_units(model)
    ]


def case_options_object_and_keywords_shard_alike(rank, world):
    """memfit.ShardOptions passed as options= and the same options as keywords (memfit's or
    torch's spellings) give the same units and the same step, for shard() and FSDP."""
    bf16 = memfit.MixedPrecision(torch.bfloat16)
    for options, kwargs in [
        (
            memfit.ShardOptions(auto_wrap_policy=AttnBlock, reshard_after_forward=False, offload="cpu"),
            {"auto_wrap_policy": AttnBlock, "reshard_after_forward": False, "offload": "cpu"},
        ),
        (
            memfit.ShardOptions(auto_wrap_policy=AttnBlock, mixed_precision=bf16, group=dist.group.WORLD),
            {
                "auto_wrap_policy": ModuleWrapPolicy({AttnBlock}),
                "mixed_precision": TorchMixedPrecision(param_dtype=torch.bfloat16),
                "process_group": dist.group.WORLD,
            },
        ),
    ]:
        ours, spelt = (
            memfit.FullyShardedDataParallel(make_model("lm"), options=options),
            memfit.FullyShardedDataParallel(make_model("lm"), **kwargs),
        )
        assert unit_config(ours) == unit_config(spelt)
        assert one_step_loss(ours) == one_step_loss(spelt)
    options = memfit.ShardOptions(reshard_after_forward=False, mixed_precision=bf16)
    ours = memfit.shard(make_model("lm"), options=options)
    spelt = memfit.shard(make_model("lm"), reshard_after_forward=False, mixed_precision=bf16)
    assert unit_config(ours) == unit_config(spelt) and unit_config(ours)[0][1:3] == (False, torch.bfloat16)
    assert one_step_loss(ours) == one_step_loss(spelt)


CASES = [
    case_options_object_and_keywords_shard_alike,
    case_torch_wrap_policies_pick_the_same_units,
    case_torch_mixed_precision,
    case_sharding_strategy,
    case_torch_keywords,
    case_fairscale_keywords,
]
GROUP = Subtests(CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compat(case):
    GROUP.check(case, 2)
