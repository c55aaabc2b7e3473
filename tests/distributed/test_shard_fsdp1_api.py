"""FSDP1's checkpoint and utility API on memfit.FullyShardedDataParallel, against an unsharded
run of the same model (what DDP computes): state_dict_type (FULL_STATE_DICT with offload_to_cpu
and rank0_only, SHARDED_STATE_DICT through DCP), optim_state_dict / optim_state_dict_to_load,
FSDP.summon_full_params and model.clip_grad_norm_. One spawned group of 2 ranks."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import memfit
from memfit import FullyShardedDataParallel as FSDP
from tests._dist import Subtests, case_id
from tests.distributed.test_shard_dcp import assert_same, build, train

VOCAB = 301  # uneven shards
TOL = {"rtol": 1e-5, "atol": 1e-6}  # sharded vs unsharded: the same sums in another order
FULL = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True), FullOptimStateDictConfig(rank0_only=True))


def trained(kind="adam", steps=2):
    model, opt = build(kind, VOCAB)
    ref, ref_opt = build(kind, VOCAB, sharded=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    train(model, opt, steps, 0, rank, world, VOCAB)
    train(ref, ref_opt, steps, 0, 0, 1, VOCAB)
    return model, opt, ref, ref_opt


def case_full_state_dict_rank0_only_offloaded(rank, world, root):
    model, _, ref, _ = trained()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FULL[0]):
        sd = model.state_dict()
    with memfit.summon_full_params(model, writeback=False):  # every rank: collectives
        summoned = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        assert all(t.device.type == "cpu" and not isinstance(t, DTensor) for t in sd.values())
        assert_same(sd, ref.state_dict(), "full state dict", **TOL)
        assert_same(sd, summoned, "full vs summoned")
    else:
        assert sd == {}, "rank0_only: the other ranks get an empty dict"
    assert all(isinstance(v, DTensor) for k, v in model.state_dict().items() if k.endswith("weight"))  # restored
    # FULL_STATE_DICT on every rank loads back into a fresh model, exactly.
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        sd = model.state_dict()
    fresh, _ = build("adam", VOCAB, seed=1)
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        fresh.load_state_dict(sd)
        assert_same(fresh.state_dict(), sd, "full load")


def case_optim_state_dict_full_and_rank0_only(rank, world, root):
    for kind in ("adam", "sgd"):
        model, opt, ref, ref_opt = trained(kind)
        osd = FSDP.optim_state_dict(model, opt)  # no type set: FSDP1's default, FULL_STATE_DICT
        assert_same(osd, get_optimizer_state_dict(ref, ref_opt), f"{kind} full optim state", **TOL)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FULL[1]):
            msd = model.state_dict()
            osd0 = FSDP.optim_state_dict(model, opt)
        assert (osd0 == {}) == (rank != 0), "rank0_only: the other ranks get an empty dict"
        msd, osd0 = tree_map_only(torch.Tensor, torch.clone, (msd, osd0))  # the step scalars are the optimizer's
        cont = train(model, opt, 2, 2, rank, world, VOCAB)
        # A fresh model and optimizer back at step 2: the model full on every rank, the optimizer
        # from rank 0 (broadcast by optim_state_dict_to_load).
        model2, opt2 = build(kind, VOCAB, seed=1)
        with FSDP.state_dict_type(model2, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FULL[1]):
            model2.load_state_dict(msd)
            opt2.load_state_dict(FSDP.optim_state_dict_to_load(model2, opt2, osd0))
        assert train(model2, opt2, 2, 2, rank, world, VOCAB) == cont, kind


def case_full_optim_state_dict_and_scatter(rank, world, root):
    for kind in ("adam", "sgd"):
        model, opt, _, ref_opt = trained(kind)
        full = FSDP.full_optim_state_dict(model, opt)  # rank0_only by default
        if rank == 0:
            assert_same(full, ref_opt.state_dict(), f"{kind} full optim state by ids", **TOL)
        else:
            assert full == {}
        full = tree_map_only(torch.Tensor, torch.clone, full)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            msd = model.state_dict()
        cont = train(model, opt, 2, 2, rank, world, VOCAB)
        model2, opt2 = build(kind, VOCAB, seed=1)
        model2.load_state_dict(msd)
        opt2.load_state_dict(FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, model2, optim=opt2))
        assert train(model2, opt2, 2, 2, rank, world, VOCAB) == cont, kind


def case_sharded_state_dict_through_dcp(rank, world, root):
    model, opt, _, _ = trained()
    path = os.path.join(root, "sharded")
    sharded = (ShardedStateDictConfig(), ShardedOptimStateDictConfig())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, *sharded):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    assert isinstance(state["optim"]["state"]["emb.weight"]["exp_avg"], DTensor)
    dcp.save(state, checkpoint_id=path)
    cont = train(model, opt, 2, 2, rank, world, VOCAB)
    model2, opt2 = build("adam", VOCAB, seed=1)
    with FSDP.state_dict_type(model2, StateDictType.SHARDED_STATE_DICT, *sharded):
        state = {"model": model2.state_dict(), "optim": FSDP.optim_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=path)
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(FSDP.optim_state_dict_to_load(model2, opt2, state["optim"]))
    assert train(model2, opt2, 2, 2, rank, world, VOCAB) == cont


def case_settings_and_refusals(rank, world, root):
    model, _ = build("adam", VOCAB)
    assert FSDP.get_state_dict_type(model).state_dict_type == StateDictType.SHARDED_STATE_DICT
    prev = FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig())
    assert prev.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert not any(isinstance(v, DTensor) for v in model.state_dict().values())
    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    assert isinstance(model.state_dict()["emb.weight"], DTensor)
    with pytest.raises(NotImplementedError, match=r"LOCAL_STATE_DICT.*SHARDED_STATE_DICT"):
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(ValueError, match="FULL_STATE_DICT takes a FullStateDictConfig"):
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig())


def case_summon_full_params_and_clip_grad_norm(rank, world, root):
    model, opt, ref, ref_opt = trained()
    with FSDP.summon_full_params(model, writeback=False):
        assert_same(dict(model.named_parameters()), dict(ref.named_parameters()), "summoned", **TOL)
    with model.summon_full_params(model):  # the instance spelling, writing back
        model.head.weight.data.mul_(0.5)
    with torch.no_grad():
        ref.head.weight.mul_(0.5)
    ids = torch.randint(VOCAB, (12, 6), generator=torch.Generator().manual_seed(9))
    for m, part in ((model, ids[rank * 6 : (rank + 1) * 6]), (ref, ids)):
        logits = m(part[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), part[:, 1:].reshape(-1)).backward()
    norm = model.clip_grad_norm_(0.1)
    want = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.1)
    assert isinstance(norm, torch.Tensor)
    torch.testing.assert_close(norm, want, **TOL)
    opt.step()
    ref_opt.step()
    with FSDP.summon_full_params(model, writeback=False):
        assert_same(dict(model.named_parameters()), dict(ref.named_parameters()), "after a clipped step", **TOL)


CASES = [
    case_full_state_dict_rank0_only_offloaded,
    case_optim_state_dict_full_and_rank0_only,
    case_full_optim_state_dict_and_scatter,
    case_sharded_state_dict_through_dcp,
    case_settings_and_refusals,
    case_summon_full_params_and_clip_grad_norm,
]
GROUP = Subtests(CASES, timeout=600)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp1"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fsdp1_api(root, case):
    GROUP.check(case, 2, root)
