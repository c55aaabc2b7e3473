"""memfit.fully_shard against torch's own FSDP2 (torch.distributed.fsdp.fully_shard, which runs
on gloo): the same tied-embedding transformer, the same seed and data, sharded per block then at
the root by each; losses every step and the final parameters (full_tensor of the state dicts)
compared. One spawned group of 2 ranks runs every case.

Tolerance: exact in fp32. Both gather the same full parameters, run the same forward and
backward ops, and average the gradients of 2 ranks with one addition and one exact division by 2;
AdamW then runs the same per-parameter arithmetic (foreach=False on both, since torch's FSDP2
holds DTensors), so nothing differs but the sharded layout. In bf16 too (measured exact): the
division by 2 is exact in bf16, so memfit's divide-then-sum and torch's sum-then-divide agree.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import memfit
from memfit._shard._fully_shard import FSDPModule, options_of
from memfit._shard._unit import ShardState
from tests._dist import Subtests, case_id
from tests._models import TinyLM

VOCAB, SEQ = 37, 8  # 37 rows: uneven shards at W=2
EXACT = {"rtol": 0.0, "atol": 0.0}


def build(kind, *, per_block=None, root=None, seed=0, **kwargs):
    """TinyLM sharded by ``kind``'s fully_shard: each block (``per_block(i, block)`` adds its
    keyword arguments), then the root (``root(model)`` adds the root's)."""
    torch.manual_seed(seed)
    model = TinyLM(vocab=VOCAB, d=16, layers=2)
    fs = memfit.fully_shard if kind == "memfit" else torch_fully_shard
    for i, b in enumerate(model.blocks):
        fs(b, **kwargs, **(per_block(i, b) if per_block else {}))
    return fs(model, **kwargs, **(root(model) if root else {}))


def batch(step, rank):
    return torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def train(model, steps=3, micro=1, before=None, lr=1e-2):
    """Losses of ``steps`` AdamW steps of ``micro`` micro-batches; ``before(model, i, last)`` runs
    before each micro-batch's forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        for i in range(micro):
            if before is not None:
                before(model, i, i == micro - 1)
            loss = loss_of(model, batch(step * micro + i, rank))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def full_state(model):
    sd = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def assert_same_run(kwargs=None, tol=EXACT, **train_kwargs):
    """memfit's and torch's fully_shard, built with ``kwargs`` and trained alike, agree."""
    kwargs = kwargs or {}
    ref, got = build("torch", **kwargs), build("memfit", **kwargs)
    want_losses, losses = train(ref, **train_kwargs), train(got, **train_kwargs)
    torch.testing.assert_close(losses, want_losses, **tol)
    want, have = full_state(ref), full_state(got)
    assert sorted(have) == sorted(want)
    for k in want:
        torch.testing.assert_close(have[k], want[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    return ref, got


def case_parity_fp32(rank, world):
    _, got = assert_same_run()
    assert type(got).__name__ == "FSDPModuleTinyLM" and isinstance(got, TinyLM)
    assert all(isinstance(m, FSDPModule) for m in (got, *got.blocks))
    assert not isinstance(got.norm, FSDPModule)
    assert [type(m._memfit_unit.module) for m in (got, *got.blocks)] == [type(got), *map(type, got.blocks)]
    assert got.embed.weight is got.head.weight  # the tie survives
    rows = (VOCAB + 1) // 2
    assert got.embed.weight.shape == (rows if rank == 0 else VOCAB - rows, 16)  # torch.chunk rows


def _accumulate(keep):
    def before(model, i, last):
        model.set_requires_gradient_sync(last)  # no communication on the first micro-batches
        model.set_reshard_after_backward(last or not keep)  # torchtitan's pattern: no re-gather either
        model.set_is_last_backward(last)

    return before


def case_gradient_accumulation(rank, world):
    # bf16 compute, fp32 reduce: the micro-batches' gradients are summed in fp32, as FSDP2 sums them
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert_same_run({"mp_policy": mixed}, steps=2, micro=3, before=_accumulate(keep=False))
    ref, got = assert_same_run(steps=2, micro=3, before=_accumulate(keep=True))
    # After a backward that kept the parameters, both models hold full ones.
    for model in (ref, got):
        _accumulate(keep=True)(model, 0, False)
        loss_of(model, batch(9, rank)).backward()
    assert not isinstance(ref.blocks[0].qkv.weight, DTensor)  # torch: the unsharded parameter
    assert got.blocks[0]._memfit_unit.shard_state is ShardState.UNSHARDED
    assert got.blocks[0].qkv.weight.shape == ref.blocks[0].qkv.weight.shape == (48, 16)
    # Kept after every backward, even across optimizer steps: memfit gathers again once a step
    # changed the shards, so the numbers do not change (FSDP2 leaves that to the user).
    base = train(build("memfit"), steps=2, micro=2)
    kept = train(build("memfit"), steps=2, micro=2, before=lambda m, i, last: m.set_reshard_after_backward(False))
    assert kept == base


def case_reshard_after_forward_false(rank, world):
    ref, got = assert_same_run({"reshard_after_forward": False})
    for model in (ref, got):
        model(batch(0, rank)[:, :-1])  # forward only
    assert not isinstance(ref.blocks[1].qkv.weight, DTensor)
    assert got.blocks[1]._memfit_unit.shard_state is ShardState.UNSHARDED
    for model in (ref, got):
        model.set_reshard_after_forward(True)
        loss_of(model, batch(1, rank)).backward()  # the kept ones are used and freed in this backward
        model(batch(0, rank)[:, :-1])
    assert isinstance(ref.blocks[1].qkv.weight, DTensor)
    assert got.blocks[1]._memfit_unit.shard_state is ShardState.SHARDED
    with pytest.raises(ValueError, match="should be a bool"):
        got.set_reshard_after_forward(2)  # type: ignore[arg-type]


def case_mixed_precision_bf16(rank, world):
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for mp in (
        bf16,
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    ):
        ref, got = assert_same_run({"mp_policy": mp}, steps=2)
        assert got.blocks[0]._memfit_unit.input_dtype is torch.bfloat16
        assert got.norm.weight.dtype == got.embed.weight.dtype == torch.float32  # the shards stay fp32
        out = got(batch(0, rank)[:, :-1])
        assert out.dtype == ref(batch(0, rank)[:, :-1]).dtype == torch.bfloat16
    # output_dtype on the root: floating outputs cast back, as FSDP2 does
    fp32_out = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    blocks = {"per_block": lambda i, b: {"mp_policy": bf16}, "root": lambda m: {"mp_policy": fp32_out}}
    ref, got = assert_same_run(blocks, steps=1)
    assert got(batch(0, rank)[:, :-1]).dtype == torch.float32


def case_ignored_params(rank, world):
    def ignore_bias(i, block):
        return {"ignored_params": {block.proj.bias}} if i == 0 else {}

    ref, got = assert_same_run({"per_block": ignore_bias})
    for model in (ref, got):
        bias = model.blocks[0].proj.bias
        assert type(bias) is nn.Parameter and bias.shape == (16,)  # full, a plain parameter
        loss_of(model, batch(7, rank)).backward()
    torch.testing.assert_close(got.blocks[0].proj.bias.grad, ref.blocks[0].proj.bias.grad, **EXACT)
    grads = [torch.empty(16) for _ in range(world)]
    dist.all_gather(grads, got.blocks[0].proj.bias.grad)
    assert not torch.equal(grads[0], grads[1])  # each rank's own gradient: not reduced
    assert got.blocks[0].proj.bias not in got.blocks[0]._memfit_unit.params


def train_clipped(model, norm_type, max_norm=0.05, steps=3, **clip):
    """Losses and norms of ``steps`` AdamW steps that clip with torch's own
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, the call an FSDP2 script keeps
    after the import swap; each norm read as FSDP2 users read it (full_tensor of a DTensor)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    rank, losses, norms = dist.get_rank(), [], []
    for step in range(steps):
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, **clip)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def case_torch_clip_grad_norm_matches_fsdp2(rank, world):
    """torch.nn.utils.clip_grad_norm_ on memfit.fully_shard's model clips by FSDP2's global norm,
    bit for bit (See [Note: Sharded gradients and torch's clip_grad_norm_]): the 2-, 1- and
    inf-norms, torch's foreach path too; max_norm 0.05 clips every step (the norms are ~6)."""
    for norm_type, clip in [(2.0, {}), (1.0, {}), (float("inf"), {}), (2.0, {"foreach": True})]:
        ref, got = build("torch"), build("memfit")
        want_losses, want_norms = train_clipped(ref, norm_type, **clip)
        losses, norms = train_clipped(got, norm_type, **clip)
        assert norms == want_norms, (norm_type, clip, norms, want_norms)
        assert losses == want_losses, (norm_type, clip, losses, want_losses)
        assert min(norms) > 0.05  # clipping did happen
        want, have = full_state(ref), full_state(got)
        for k in want:
            torch.testing.assert_close(have[k], want[k], **EXACT, msg=lambda m, k=k, n=norm_type: f"{k} ({n}): {m}")


def case_shard_grad_norms_read_as_one_tensor(rank, world):
    """A chunk's gradient answers a whole-tensor norm with the norm of the whole gradient (as a
    DTensor's full_tensor() of it), every other op with this rank's rows; memfit.clip_grad_norm_
    still reduces once (its norm is the single-process one, whatever the gradients' type)."""
    ref, got = build("torch"), build("memfit")
    for m in (ref, got):
        loss_of(m, batch(0, rank)).backward()
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        g, want = p.grad, q.grad
        assert type(g).__name__ == "ShardGrad", (name, type(g))
        whole = torch.linalg.vector_norm(want.full_tensor())
        assert g.norm().item() == want.norm().full_tensor().item() == pytest.approx(whole.item(), rel=1e-6), name
        assert torch.linalg.vector_norm(g, float("inf")).item() == want.full_tensor().abs().max().item(), name
        local = torch.linalg.vector_norm(g, 2.0, dim=0)  # over some dims: this rank's rows
        assert type(local) is torch.Tensor and torch.equal(local, torch.linalg.vector_norm(want.to_local(), 2.0, dim=0))
        assert type(g * 2) is torch.Tensor and torch.equal(g * 2, want.to_local() * 2), name
    part = got.embed.weight.grad.norm()
    assert type(part).__name__ == "PartialNorm" and part.shape == () and part._memfit_reduced is None
    first = part.item()  # every rank: the reduction, once, on first use; then kept
    assert part._memfit_reduced is not None
    if rank == 0:  # one rank alone reads it again: no collective (it would hang)
        assert part.item() == first == ref.embed.weight.grad.norm().full_tensor().item()
    else:
        ref.embed.weight.grad.norm().full_tensor()
    total = torch.nn.utils.get_total_norm([p.grad for p in got.parameters()])
    assert type(total) is torch.Tensor  # the stack's norm: reduced (as FSDP2's is Replicate)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).full_tensor().item()
    assert total.item() == want
    assert memfit.clip_grad_norm_(got, 1e9) == pytest.approx(want, rel=1e-6)


def case_unshard_reshard(rank, world):
    ref, got = build("torch"), build("memfit")
    for model in (ref, got):
        model.blocks[0].unshard()
    assert got.blocks[0]._memfit_unit.shard_state is ShardState.UNSHARDED
    torch.testing.assert_close(got.blocks[0].qkv.weight, ref.blocks[0].qkv.weight, **EXACT)  # full, both
    assert got.blocks[0].qkv.weight.shape == (48, 16)
    assert got.blocks[1]._memfit_unit.shard_state is ShardState.SHARDED  # not recursive
    for model in (ref, got):
        model.blocks[0].reshard()
        handle = model.unshard(async_op=True)
        assert handle is not None
        handle.wait()
    assert got.embed.weight.shape == (VOCAB, 16)
    torch.testing.assert_close(got.embed.weight, ref.embed.weight, **EXACT)
    with torch.no_grad():
        torch.testing.assert_close(got(batch(0, rank)), ref(batch(0, rank)), **EXACT)
    got.reshard()
    assert got.embed.weight.shape[0] < VOCAB
    assert train(got, steps=1) == train(ref, steps=1)


def _prefetch(model):
    blocks = list(model.blocks)
    for i, b in enumerate(blocks):
        if i + 1 < len(blocks):
            b.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            b.set_modules_to_backward_prefetch([blocks[i - 1]])
    model.set_modules_to_forward_prefetch([blocks[0]])


def case_prefetch_setters(rank, world):
    seen = {}

    def watch(model, explicit):
        """Record the state of block 1's unit when block 0's forward starts, and of block 0's
        unit during block 1's backward, in the first step (no recorded order yet)."""
        if explicit:
            _prefetch(model)
        b0, b1 = model.blocks

        def on_b0(m, args):
            seen.setdefault(("fwd", explicit), b1._memfit_unit.shard_state)

        def on_grad(grad):
            seen.setdefault(("bwd", explicit), b0._memfit_unit.shard_state)

        b0.register_forward_pre_hook(on_b0)
        b1.ff.register_forward_hook(lambda m, a, out: out.register_hook(on_grad) and None)
        loss_of(model, batch(0, rank)).backward()

    watch(build("memfit"), explicit=False)
    watch(build("memfit"), explicit=True)
    assert seen[("fwd", False)] is ShardState.SHARDED and seen[("bwd", False)] is ShardState.SHARDED
    assert seen[("fwd", True)] is not ShardState.SHARDED, "block 1 was not prefetched in forward"
    assert seen[("bwd", True)] is not ShardState.SHARDED, "block 0 was not prefetched in backward"
    ref, got = build("torch"), build("memfit")
    _prefetch(ref)
    _prefetch(got)
    assert train(got) == train(ref)
    with pytest.raises(ValueError, match=r"takes modules memfit\.fully_shard sharded; got \['Linear'\]"):
        got.set_modules_to_forward_prefetch([nn.Linear(2, 2)])


def case_gradient_divide_factor(rank, world):
    """Against memfit's default (torch's FSDP2 needs ReduceOp.PREMUL_SUM for it, which gloo lacks):
    factor 1 sums the gradients, W times the average (exact: W=2); factor W is the average."""
    grads = {}
    for factor in (None, 1.0, float(world)):
        model = build("memfit")
        if factor is not None:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(factor)
        loss_of(model, batch(0, rank)).backward()
        grads[factor] = [p.grad for p in model.parameters()]
    for avg, summed, by_world in zip(grads[None], grads[1.0], grads[float(world)]):
        torch.testing.assert_close(summed, world * avg, **EXACT)
        torch.testing.assert_close(by_world, avg, **EXACT)


def case_cpu_offload_policy(rank, world):
    """The logic only: on a CPU-only machine the compute device is the CPU too."""
    _, got = assert_same_run({"offload_policy": CPUOffloadPolicy(pin_memory=False)}, steps=2)
    assert got.blocks[0]._memfit_unit.params[0].sharded.device.type == "cpu"


def case_options_and_refusals(rank, world):
    p = nn.Parameter(torch.zeros(2))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    want = memfit.ShardOptions(
        reshard_after_forward=True,
        sync_module_states=False,
        mixed_precision=memfit.MixedPrecision(torch.bfloat16, keep_norms_fp32=False),
        offload="cpu",
        ignored_params=frozenset({p}),
    )
    assert options_of(None, None, bf16, CPUOffloadPolicy(), {p}) == want
    assert options_of(None, 2, MixedPrecisionPolicy(), OffloadPolicy(), None) == memfit.ShardOptions(
        reshard_after_forward=2, sync_module_states=False
    )
    with pytest.raises(TypeError, match=r"mp_policy must be a torch\.distributed\.fsdp\.MixedPrecisionPolicy"):
        memfit.fully_shard(nn.Linear(2, 2), mp_policy=memfit.MixedPrecision())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offload_policy must be"):
        memfit.fully_shard(nn.Linear(2, 2), offload_policy="cpu")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="one call shards one module"):
        memfit.fully_shard([nn.Linear(2, 2), nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="dp_mesh_dims"):
        memfit.fully_shard(nn.Linear(2, 2), dp_mesh_dims=object())
    with pytest.raises(NotImplementedError, match=r"places Linear's parameter 'weight' on Shard\(dim=1\)"):
        memfit.fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda q: Shard(1))
    lin = memfit.fully_shard(nn.Linear(4, 2), shard_placement_fn=lambda q: Shard(0) if q.dim() > 1 else None)
    assert isinstance(lin, FSDPModule)
    with pytest.raises(ValueError, match="already sharded"):
        memfit.fully_shard(lin)
    with pytest.raises(TypeError, match=r"ignored_params must hold nn\.Parameters only"):
        memfit.ShardOptions(ignored_params={torch.zeros(2)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive factor"):
        lin.set_gradient_divide_factor(0)


CASES = [
    case_parity_fp32,
    case_gradient_accumulation,
    case_reshard_after_forward_false,
    case_mixed_precision_bf16,
    case_ignored_params,
    case_torch_clip_grad_norm_matches_fsdp2,
    case_shard_grad_norms_read_as_one_tensor,
    case_unshard_reshard,
    case_prefetch_setters,
    case_gradient_divide_factor,
    case_cpu_offload_policy,
    case_options_and_refusals,
]
GROUP = Subtests(CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fully_shard(case):
    GROUP.check(case, 2)
