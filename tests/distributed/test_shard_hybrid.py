"""Hybrid sharding (HSDP) on a 2-D (replicate x shard) mesh: parity with one process, bytes
per process group, torch FSDP's HYBRID_SHARD spellings, checkpoints across layouts.

One spawned group of 4 ranks runs every case (as 2x2, 1x4 and 4x1 meshes; the checkpoint case
also shards over 3 and over 1 of the 4 ranks). Parity tolerances are test_shard's: fp32, only
the order of the gradient sum differs (1e-6 relative).
"""

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy

import memfit
import memfit.testing
from tests._dist import Subtests, case_id
from tests._models import AttnBlock, make_model
from tests._parity import my_rows
from tests.distributed.test_shard import batch, full_params, global_batch, loss_of, train_parity

SHAPES = [(2, 2), (1, 4), (4, 1)]  # (replicas, shards)


def aligned16(n: int) -> int:
    """``n`` fp32 elements rounded up to a multiple of 16 bytes: a collective slot's size."""
    return -(-n // 4) * 4


def mesh_of(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def hybrid(mesh):
    def wrap(m):
        for b in m.blocks:
            memfit.shard(b, mesh=mesh)
        return memfit.shard(m, mesh=mesh)

    return wrap


# -- parity ------------------------------------------------------------------------------------


def case_parity_2x2_1x4_4x1_uneven_shards(rank, world, _root):
    for shape in SHAPES:
        mesh = mesh_of(shape)
        model, ref = train_parity("mlp", rank, world, hybrid(mesh))
        shard_rank, shards = mesh.get_local_rank(1), shape[1]
        local = dict(model.named_parameters())
        for n, p in ref.named_parameters():  # sharded over the shard dimension only
            assert local[n].shape == my_rows(p, shard_rank, shards).shape, (shape, n)
        if shards == 4:
            assert local["scale"].numel() == (1 if shard_rank == 0 else 0)  # empty shards


def case_tied_lm_head_2x2(rank, world, _root):
    mesh = mesh_of((2, 2))

    def wrap(m):
        return memfit.FullyShardedDataParallel(
            m, auto_wrap_policy=AttnBlock, sharding_strategy="HYBRID_SHARD", device_mesh=mesh
        )

    train_parity("lm", rank, world, wrap)


def case_hybrid_shard_spellings_match_mesh(rank, world, _root):
    mesh = mesh_of((2, 2))
    shard_pg, replicate_pg = mesh.get_group("shard"), mesh.get_group("replicate")
    spellings = [
        {"device_mesh": mesh},
        {"process_group": (shard_pg, replicate_pg)},
        {},  # LOCAL_WORLD_SIZE, as torchrun sets it: consecutive ranks share a shard group
    ]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        for kwargs in spellings:

            def wrap(m, kw=kwargs):
                return memfit.FullyShardedDataParallel(
                    m, auto_wrap_policy=nn.Sequential, sharding_strategy=ShardingStrategy.HYBRID_SHARD, **kw
                )

            model, _ = train_parity("mlp", rank, world, wrap, steps=2)
            for u in memfit.testing.sharded_units(model):
                assert dist.get_process_group_ranks(u.group) == dist.get_process_group_ranks(shard_pg), kwargs
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    zero2 = memfit.FullyShardedDataParallel(
        make_model("mlp"), device_mesh=mesh, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2
    )
    assert {u.reshard_after_forward for u in memfit.testing.sharded_units(zero2)} == {False}
    with pytest.raises(ValueError, match="pass group= or mesh=, not both"):
        memfit.shard(make_model("mlp"), group=dist.group.WORLD, mesh=mesh)
    with pytest.raises(ValueError, match="sharding_strategy=FULL_SHARD shards over every rank of a 1-D"):
        memfit.FullyShardedDataParallel(make_model("mlp"), device_mesh=mesh, sharding_strategy="FULL_SHARD")
    flipped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "dp_replicate"))
    flip_fix = r"dimensions are \(replicate, shard\).*mesh_dim_names=\('dp_replicate', 'dp_shard'\)"
    with pytest.raises(ValueError, match=flip_fix):
        memfit.shard(make_model("mlp"), mesh=flipped)
    with pytest.raises(ValueError, match="HYBRID_SHARD needs a 2-D"):
        memfit.FullyShardedDataParallel(
            make_model("mlp"), device_mesh=init_device_mesh("cpu", (4,)), sharding_strategy="HYBRID_SHARD"
        )


def case_clip_grad_norm_hsdp_and_mixed_layouts(rank, world, _root):
    """The norm counts each shard once (the replicas hold the same ones), whether every unit is
    hybrid or the blocks are hybrid and the root is plainly sharded over all 4 ranks: equal to
    the single-process norm, the same float on every rank."""
    mesh = mesh_of((2, 2))

    def mixed(m):
        for b in m.blocks:
            memfit.shard(b, mesh=mesh)
        return memfit.shard(m)

    for wrap in (hybrid(mesh), mixed):
        for norm_type in (2.0, float("inf")):
            ref = make_model("lm")
            model = wrap(copy.deepcopy(ref))
            loss_of("lm", model, *batch("lm", rank, 0)).backward()
            loss_of("lm", ref, *global_batch("lm", world, 0)).backward()
            got = memfit.clip_grad_norm_(model, 0.01, norm_type)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type).item()
            # per-shard partial norms combined across ranks vs one fp32 reduction: rounding order
            assert abs(got - want) <= 1e-5 * want, (wrap, norm_type, got, want)
            gathered = [None] * world
            dist.all_gather_object(gathered, got)
            assert len(set(gathered)) == 1, gathered
    model = make_model("lm")
    for b in model.blocks:
        memfit.shard(b, group=mesh.get_group("shard"))  # 2 ranks; the root over 4
    model = memfit.shard(model)
    loss_of("lm", model, *batch("lm", rank, 0)).backward()
    with pytest.raises(ValueError, match="sharded over different sets of ranks"):
        memfit.clip_grad_norm_(model, 1.0)


def case_mesh_sliced_from_a_larger_one(rank, world, _root):
    """A 2-D mesh sliced from a 3-D one (FSDP2's mesh["dp_replicate", "dp_shard"] beside a
    pipeline dimension) holds other ranks on other ranks: its groups are made by its members
    (every rank asking for the group of its own slice hung in shard)."""
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    model = memfit.shard(make_model("mlp"), mesh=mesh3["dp_replicate", "dp_shard"])
    loss_of("mlp", model, *batch("mlp", rank, 0)).backward()
    unit = memfit.testing.sharded_units(model)[0]
    assert dist.get_process_group_ranks(unit.layout.everyone) == [rank // 2 * 2, rank // 2 * 2 + 1]
    memfit.clip_grad_norm_(model, 1.0)


# -- bytes per process group -------------------------------------------------------------------


def case_bytes_per_link(rank, world, _root):
    """Per rank and step: the replicate group carries only the all-reduce of each unit's reduced
    shard, 2 (R-1)/R x its reduce slot (1/S of the gradients, plus the flags and check sums);
    the shard group carries plain sharding's traffic at W = S."""
    replicas, shards = 2, 2
    mesh = mesh_of((replicas, shards))
    model = hybrid(mesh)(make_model("mlp"))
    units = memfit.testing.sharded_units(model)
    x, y = batch("mlp", rank, 0)
    loss_of("mlp", model, x, y).backward()
    stats = memfit.testing.collective_stats()
    stats.reset()
    with memfit.testing.OpCounter() as ops:
        loss_of("mlp", model, x, y).backward()
    # OpCounter prices each collective the dispatcher sees in its own group, as the stats do.
    assert ops.wire_bytes == pytest.approx(stats.bytes)  # byte counts, one side through float (W-1)/W
    shard_pg, replicate_pg = mesh.get_group("shard"), mesh.get_group("replicate")
    across, within = stats.of(replicate_pg), stats.of(shard_pg)
    # Each unit's reduce slot on this rank: its rows of every parameter, a flag per parameter, 2 check
    # sums, padded to 16 bytes (fp32).
    reduce_slot = {u: aligned16(sum(p.slot_numel + 1 for p in u.params) + 2) * 4 for u in units}
    gather_slot = {u: aligned16(sum(p.slot_numel for p in u.params) + 1) * 4 for u in units}
    ring_r, ring_s = (replicas - 1) / replicas, (shards - 1) / shards
    assert across.all_reduce_bytes == sum(2 * ring_r * b for b in reduce_slot.values())
    assert across.all_gathers == across.reduce_scatters == 0
    assert across.all_reduces == len(units)
    regathered = units[1:]  # every unit but the root gathers again for backward
    assert within.all_gather_bytes == sum(shards * ring_s * gather_slot[u] for u in [*units, *regathered])
    assert within.reduce_scatter_bytes == sum(shards * ring_s * reduce_slot[u] for u in units)
    assert within.all_reduces == 0
    # The gradient bytes crossing the replicate dimension are about Psi/S of them, not Psi.
    psi = sum(p.numel() for p in make_model("mlp").parameters()) * 4
    padding = sum(p.row_numel for u in units for p in u.params) * 4  # at most one row per parameter
    extras = sum(len(u.params) + 2 for u in units) * 4  # flags and check sums
    assert psi / shards <= sum(reduce_slot.values()) <= psi / shards + padding + extras


def case_replicated_computes_on_its_parameters_as_ddp(rank, world, _root):
    """A (R, 1) mesh (shard groups of one rank) runs as DDP: the parameters are the chunks
    themselves (no gather, no copy), one all-reduce per unit and synced backward, none under
    no_sync; gradients as DDP's within fp32 rounding (the mean's order differs), across
    accumulation and gradients kept from the step before (zero_grad(set_to_none=False)).
    Fails on the old code: the units gathered into copies of the parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_of((world, 1))
    torch.manual_seed(0)
    ref = make_model("mlp")
    model = hybrid(mesh)(copy.deepcopy(ref))
    ddp = DDP(ref)
    units = memfit.testing.sharded_units(model)
    tensors = [p for u in units for p in u.params if p.full.dim() > 0]  # a 0-dim one has a chunk of 1 row
    assert len(tensors) > 1 and all(p.direct for p in tensors)
    named = dict(model.named_parameters())
    stats = memfit.testing.collective_stats()
    for step in range(3):
        micro = [batch("mlp", rank, 2 * step + k) for k in range(2)]
        stats.reset()
        for k, (x, y) in enumerate(micro):
            last = k == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                out = loss_of("mlp", model, x, y)
                assert all(p.full is p.sharded for p in tensors)  # computes on them
                out.backward()
            if not last:
                assert stats.all_gathers == stats.all_reduces == stats.reduce_scatters == 0
        assert stats.all_reduces == len(units) and stats.all_gathers == stats.reduce_scatters == 0
        for k, (x, y) in enumerate(micro):
            with contextlib.nullcontext() if k == len(micro) - 1 else ddp.no_sync():
                out = loss_of("mlp", ddp, x, y)
                out.backward()
        for n, p in ddp.module.named_parameters():
            torch.testing.assert_close(
                named[n].grad.view(p.shape), p.grad, rtol=1e-6, atol=1e-7, msg=f"{n} at step {step}"
            )
        if step == 1:  # the gradients stay and the next step adds to them
            for m in (model, ddp.module):
                m.zero_grad(set_to_none=False)


def case_replicated_refuses_a_divide_factor_and_reduces_outside_calls(rank, world, _root):
    """(R, 1) mesh: gradients are reduced as DDP reduces them, kept ones included, which only a
    mean over the R ranks leaves right: another divide factor is refused by name (it scaled a
    kept gradient by R / factor); another reduce dtype goes through the unit's buffers. A
    unit's module called outside its forward (ModernVBERT's embedding) has its gradient reduced
    too (it stayed this rank's: the outside hook skipped direct chunks, and a prefetched one
    looked gathered)."""
    from tests.distributed.test_shard import CallsInsideUnits, Embeddings, mse_step

    mesh = mesh_of((world, 1))
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    memfit.fully_shard(model[0], mesh=mesh)
    memfit.fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"set_gradient_divide_factor\(1.0\) on .*replicated over 4 ranks"):
        model[0].set_gradient_divide_factor(1.0)
    model.set_gradient_divide_factor(float(world))  # the mean: allowed
    narrow = nn.Linear(4, 4)
    memfit.fully_shard(narrow, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    wider = nn.Linear(4, 4).to(torch.bfloat16)  # bf16 compute, fp32 reduce: no_sync sums set aside in fp32
    memfit.shard(wider, mesh=mesh, mixed_precision=memfit.MixedPrecision(torch.bfloat16, torch.float32))
    for m in (narrow, wider):  # another reduce dtype: through the unit's buffers
        assert not any(p.direct for u in memfit.testing.sharded_units(m) for p in u.params)
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    tied[2].weight = tied[0].weight  # direct in the blocks, adopted by a root reducing in bf16
    memfit.fully_shard(tied[0], mesh=mesh)
    memfit.fully_shard(tied[2], mesh=mesh)
    with pytest.raises(ValueError, match=r"'weight' of .*Linear is tied across units that reduce it in different"):
        memfit.fully_shard(tied, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    torch.manual_seed(0)
    ref = CallsInsideUnits()
    model = memfit.FullyShardedDataParallel(
        copy.deepcopy(ref),
        auto_wrap_policy={Embeddings, nn.Sequential},
        sharding_strategy="HYBRID_SHARD",
        device_mesh=mesh,
    )
    for step in range(2):
        mse_step(model, *batch("mlp", rank, step))
        mse_step(ref, *global_batch("mlp", world, step))
        for n, p in ref.named_parameters():  # fp32 sums in another order
            got = dict(model.named_parameters())[n].grad
            torch.testing.assert_close(
                got, p.grad, rtol=1e-5, atol=1e-6, msg=f"{n} {step} {(got - p.grad).abs().max()} {p.grad.abs().max()}"
            )
        for m in (model, ref):
            m.zero_grad()


# -- checkpoints across layouts ----------------------------------------------------------------


def full_state(model, opt):
    """Full parameters and full AdamW state by name, gathered over the model's shard group."""
    group = memfit.testing.sharded_units(model)[0].group
    names = {id(p): n for n, p in model.named_parameters()}
    with memfit.summon_full_params(model, writeback=False):
        out = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    for p, st in sorted(opt.state.items(), key=lambda kv: names[id(kv[0])]):
        for k, v in st.items():
            if v.dim() == 0:
                out[f"{names[id(p)]}/{k}"] = [v.item()]
                continue
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, v.reshape(-1).tolist(), group=group)
            out[f"{names[id(p)]}/{k}"] = [x for part in parts for x in part]
    return out


def build(**where):
    model = memfit.FullyShardedDataParallel(make_model("mlp"), auto_wrap_policy=nn.Sequential, **where)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def steps(model, opt, rank, n=2):
    for step in range(n):
        x, y = batch("mlp", rank, step)
        loss_of("mlp", model, x, y).backward()
        opt.step()
        opt.zero_grad()


def case_checkpoint_hsdp_to_plain_w3_w1_and_back(rank, world, root):
    mesh = mesh_of((2, 2))
    model, opt = build(device_mesh=mesh, sharding_strategy="HYBRID_SHARD")
    steps(model, opt, rank)
    path = os.path.join(root, "hsdp")
    memfit.save_checkpoint(path, model, opt, extra={"step": 2})
    saved = full_state(model, opt)
    for ranks in ([0, 1, 2], [0]):  # plain sharding at W=3 and W=1; the other ranks wait
        group = dist.new_group(ranks)
        if rank in ranks:
            plain, plain_opt = build(group=group)
            steps(plain, plain_opt, rank, n=1)  # other values, and an optimizer state to overwrite
            assert memfit.load_checkpoint(path, plain, plain_opt) == {"step": 2}
            assert full_state(plain, plain_opt) == saved, ranks
            if len(ranks) == 3:
                steps(plain, plain_opt, rank, n=1)
                memfit.save_checkpoint(os.path.join(root, "w3"), plain, plain_opt, extra={"step": 3})
                saved_w3 = full_state(plain, plain_opt)
        dist.barrier()
    box = [saved_w3 if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    back, back_opt = build(device_mesh=mesh, sharding_strategy="HYBRID_SHARD")
    assert memfit.load_checkpoint(os.path.join(root, "w3"), back, back_opt) == {"step": 3}
    assert full_state(back, back_opt) == box[0]

    # Hybrid blocks under a root sharded plainly over the 4 ranks: each unit's chunks are
    # placed on its own mesh (on the root's they loaded as other rows, silently).
    def mixed():
        model = make_model("mlp")
        for b in model.blocks:
            memfit.shard(b, mesh=mesh)
        model = memfit.shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = mixed()
    steps(model, opt, rank)
    memfit.save_checkpoint(os.path.join(root, "mixed"), model, opt)
    plain, plain_opt = build()
    memfit.load_checkpoint(os.path.join(root, "mixed"), plain, plain_opt)
    want = full_params(model)
    assert all(torch.equal(v, want[n]) for n, v in full_params(plain).items())
    again, again_opt = mixed()
    memfit.load_checkpoint(os.path.join(root, "mixed"), again, again_opt)
    assert all(torch.equal(v, want[n]) for n, v in full_params(again).items())
    for p, q in zip(opt.param_groups[0]["params"], again_opt.param_groups[0]["params"]):
        for k, v in opt.state[p].items():
            assert torch.equal(v, again_opt.state[q][k]), k


# -- partial reshard after forward --------------------------------------------------------------


def case_partial_reshard_parity_bytes_and_memory(rank, world, _root):
    """reshard_after_forward=2 over 4 shards: parity; the named formulas of [Note: Partial
    reshard after forward] for what a unit holds between forward and backward and for what
    backward's all-gather sends, per group."""
    shards, k = 4, 2
    mesh = mesh_of((1, shards))

    def wrap(m):
        for b in m.blocks:
            memfit.shard(b, mesh=mesh, reshard_after_forward=k)
        return memfit.shard(m, mesh=mesh, reshard_after_forward=k)

    train_parity("mlp", rank, world, wrap)
    model = wrap(make_model("mlp"))
    units = memfit.testing.sharded_units(model)
    root, others = units[0], units[1:]
    x, y = batch("mlp", rank, 0)
    loss_of("mlp", model, x, y).backward()
    stats = memfit.testing.collective_stats()
    stats.reset()
    loss = loss_of("mlp", model, x, y)
    # Held from forward to backward by a non-root unit: 1/k of its S gathered slots (fp32).
    gather_slot = {u: aligned16(sum(p.slot_numel for p in u.params) + 1) * 4 for u in units}
    held = {u: shards // k * gather_slot[u] for u in others}
    assert {u: u._piece.numel() * u._piece.element_size() for u in others} == held
    assert root._piece is None
    loss.backward()
    assert all(u._piece is None for u in units)  # dropped once backward gathered
    post = others[0].post_forward_group
    assert dist.get_process_group_ranks(post) == [rank // k * k + i for i in range(k)]
    # Forward gathers every unit over the shard group; backward gathers the non-root units over k ranks.
    assert stats.of(mesh.get_group("shard")).all_gather_bytes == sum(
        (shards - 1) / shards * shards * gather_slot[u] for u in units
    )
    assert stats.of(post).all_gather_bytes == sum((k - 1) / k * shards * gather_slot[u] for u in others)
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 does not divide the shard group's 4 ranks"):
        memfit.shard(make_model("mlp"), mesh=mesh, reshard_after_forward=3)


CASES = [
    case_parity_2x2_1x4_4x1_uneven_shards,
    case_tied_lm_head_2x2,
    case_clip_grad_norm_hsdp_and_mixed_layouts,
    case_hybrid_shard_spellings_match_mesh,
    case_mesh_sliced_from_a_larger_one,
    case_bytes_per_link,
    case_replicated_computes_on_its_parameters_as_ddp,
    case_replicated_refuses_a_divide_factor_and_reduces_outside_calls,
    case_checkpoint_hsdp_to_plain_w3_w1_and_back,
    case_partial_reshard_parity_bytes_and_memory,
]
GROUP = Subtests(CASES)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hybrid(case, root):
    GROUP.check(case, 4, root)
