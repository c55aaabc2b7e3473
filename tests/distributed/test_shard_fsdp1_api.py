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
from memfit._shard._unit import units_of
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
        model, opt, ref, ref_opt = trained(kind)
        full = FSDP.full_optim_state_dict(model, opt)  # rank0_only by default
        if rank == 0:  # keyed by names, as torch FSDP1's
            assert_same(full, get_optimizer_state_dict(ref, ref_opt), f"{kind} full optim state", **TOL)
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
    assert isinstance(norm, torch.Tensor) and norm.dtype == want.dtype and norm.device == want.device
    torch.testing.assert_close(norm, want, **TOL)
    opt.step()
    ref_opt.step()
    with FSDP.summon_full_params(model, writeback=False):
        assert_same(dict(model.named_parameters()), dict(ref.named_parameters()), "after a clipped step", **TOL)


def case_fsdp1_constructor_arguments(rank, world, root):
    """Every FSDP1 argument a real script passes, FSDP1's spellings, trains as memfit's own
    options do (bitwise: the same options, so the same arithmetic)."""
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tests.distributed.test_shard_dcp import LM, Block, make_opt

    torch.manual_seed(0)
    spelt = FSDP(
        LM(VOCAB),
        process_group=dist.group.WORLD,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=False),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=MixedPrecision(),  # no dtype given: full precision, as in FSDP1
        ignored_modules=None,
        param_init_fn=None,
        device_id=torch.device("cpu"),
        sync_module_states=True,
        forward_prefetch=True,
        limit_all_gathers=True,
        use_orig_params=False,
        ignored_states=None,
        device_mesh=None,
    )
    model, opt = build("adam", VOCAB)
    assert train(spelt, make_opt(spelt, "adam"), 2, 0, rank, world, VOCAB) == train(
        model, opt, 2, 0, rank, world, VOCAB
    )
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    FSDP(mlp, ignored_modules=[mlp[0]])  # FSDP1's ignored_modules: left full, as ignored_params
    assert mlp[0].weight.shape == (4, 4) and mlp[1].weight.shape == (4 // world, 4)


def case_param_init_fn_on_the_meta_device(rank, world, root):
    """FSDP1's param_init_fn for a model built on the meta device: `to_empty(recurse=False)` and
    a fill in place, or a fill alone; the full state equals the fn applied to a plain model."""
    from tests.distributed.test_shard_dcp import LM, Block

    def fill(m):
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            t.copy_(torch.linspace(-1, 1, t.numel()).reshape(t.shape) * (len(name) + 1))

    def to_empty_then_fill(m):
        m.to_empty(device=torch.device("cpu"), recurse=False)
        with torch.no_grad():
            fill(m)

    want = LM(VOCAB)
    with torch.no_grad():
        for m in want.modules():
            fill(m)
    for fn in (to_empty_then_fill, fill):
        with torch.device("meta"):
            model = LM(VOCAB)
        model = FSDP(model, auto_wrap_policy={Block}, param_init_fn=fn)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            assert_same(model.state_dict(), want.state_dict(), fn.__name__)
        x = torch.randint(VOCAB, (2, 5))
        torch.testing.assert_close(model(x), want(x), **TOL)  # the gathers read what was filled


def case_summon_rank0_only_and_offload_to_cpu(rank, world, root):
    model, _, ref, _ = trained()
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    chunks = {n: p.shape for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        params = dict(model.named_parameters())
        if rank == 0:
            assert_same(params, full, "rank 0's host copies", **TOL)
            fulls = {id(sp.full) for u in units_of(model) for sp in u.params}
            assert not any(id(p) in fulls for p in params.values()), "host copies, not the gathered tensors"
            assert all(u.shard_state.name == "SHARDED" for u in units_of(model)), "gathered a unit at a time, freed"
        else:
            assert {n: p.shape for n, p in params.items()} == chunks, "the other ranks keep their shards"
    assert {n: p.shape for n, p in model.named_parameters()} == chunks
    with FSDP.summon_full_params(model, offload_to_cpu=True):  # every rank; written back from the copies
        model.head.weight.data.mul_(0.5)
    with FSDP.summon_full_params(model, writeback=False):
        torch.testing.assert_close(model.head.weight, full["head.weight"] * 0.5, **TOL)
    with pytest.raises(NotImplementedError, match="writeback=True with rank0_only=True is not supported"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    with pytest.raises(NotImplementedError, match="with_grads=True is not supported"):
        with FSDP.summon_full_params(model, with_grads=True):
            pass


def case_clip_grad_norm_keeps_the_gradients_dtype(rank, world, root):
    """torch FSDP1 returns the norm on the gradients' device in their dtype: fp64 here."""
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(5, 3).double())
    ref = torch.nn.Linear(5, 3).double()
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(x[rank * 2 : rank * 2 + 2]).sum().mul(0.5).backward()
    ref(x).sum().mul(0.5 / world).backward()  # the ranks' gradients are averaged, as DDP's
    norm = model.clip_grad_norm_(0.01)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert norm.dtype == torch.float64 and norm.device == model.weight.grad.device
    torch.testing.assert_close(norm, want)


CASES = [
    case_full_state_dict_rank0_only_offloaded,
    case_optim_state_dict_full_and_rank0_only,
    case_full_optim_state_dict_and_scatter,
    case_sharded_state_dict_through_dcp,
    case_settings_and_refusals,
    case_summon_full_params_and_clip_grad_norm,
    case_fsdp1_constructor_arguments,
    case_param_init_fn_on_the_meta_device,
    case_summon_rank0_only_and_offload_to_cpu,
    case_clip_grad_norm_keeps_the_gradients_dtype,
]
GROUP = Subtests(CASES, timeout=600)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp1"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fsdp1_api(root, case):
    GROUP.check(case, 2, root)
