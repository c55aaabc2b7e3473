"""Mixed precision (bf16 on the CPU) against one process doing the same casts."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit._shard._mixed import _NORMS as NORM_LAYERS
from tests._dist import Subtests, case_id, test_device


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.b(self.a(x)))


def data(step, rank, world, rows=8):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(rows * world, 6, generator=g), torch.randn(rows * world, 3, generator=g)
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows], x, y


def reference(master, mp):
    """A copy that computes like memfit's mixed precision: low-precision parameters outside the
    norm layers, fp32 norms with cast inputs and outputs."""
    compute = copy.deepcopy(master)
    for m in compute.modules():
        if not isinstance(m, NORM_LAYERS):
            for name, p in m._parameters.items():
                if p is not None:
                    m._parameters[name] = nn.Parameter(p.detach().to(mp.param_dtype))
    mp.prepare(list(compute.modules()))
    return compute


def case_bf16_matches_reference(rank, world):
    reduce = torch.float32 if world > 1 else None
    mp = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    torch.manual_seed(0)
    master = Net()
    model = memfit.FullyShardedDataParallel(copy.deepcopy(master), auto_wrap_policy=nn.Sequential, mixed_precision=mp)
    compute = reference(master, mp)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(master.parameters(), lr=1e-3)
    exact = world == 1
    for step in range(3):
        x, y, gx, gy = data(step, rank, world)
        out = model(x)
        assert out.dtype == torch.bfloat16
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pc.copy_(pm)
        ref_loss = nn.functional.mse_loss(compute(gx.to(mp.param_dtype)).float(), gy)
        ref_loss.backward()
        for pc, pm in zip(compute.parameters(), master.parameters()):
            pm.grad, pc.grad = pc.grad.float(), None
        ref_opt.step()
        ref_opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        if exact:
            assert torch.equal(t / world, ref_loss.detach())
        else:  # per-rank bf16 gradients summed in fp32 against bf16 gradients of the whole batch
            torch.testing.assert_close(t / world, ref_loss.detach(), rtol=2e-2, atol=1e-3)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards stay fp32
    with memfit.summon_full_params(model, writeback=False):
        full = dict(model.named_parameters())
        for n, p in master.named_parameters():
            if exact:
                assert torch.equal(full[n].float(), p.to(full[n].dtype).float()), n
            else:
                # bf16 parameters (an ulp is 2^-7 = 7.8e-3 at 1.0): about 2.5 ulps after steps on bf16 gradients
                torch.testing.assert_close(full[n].float(), p.to(full[n].dtype).float(), rtol=0, atol=2e-2)
    bn = model.b[1]
    assert bn.weight.dtype == torch.float32 and bn.running_var.dtype == torch.float32


def case_fp16_reduce_divides_before_and_after_the_sum(rank, world):
    # Every rank's gradient is 40960 (exact in bf16 and fp16); summed over 2 ranks it would be
    # 81920, past fp16's 65504 (inf). Divided by 2 before the sum and by W/2 after it (FSDP2's
    # factors), the mean, 40960, comes out exactly. fp32 keeps one division after the sum.
    dev = test_device()
    mp = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    model = memfit.shard(nn.Linear(4, 2, bias=False).to(dev), mixed_precision=mp)
    (model(torch.ones(1, 4, device=dev)).float().sum() * 40960).backward()
    grad = model.weight.grad
    assert grad.dtype == torch.float32 and torch.equal(grad, torch.full_like(grad, 40960.0)), grad


# MixedPrecision's validation: unit/test_mixed_precision.py
CASES = [case_bf16_matches_reference, case_fp16_reduce_divides_before_and_after_the_sum]
GROUP = Subtests(CASES)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mixed_precision(world, case):
    GROUP.check(case, world)
