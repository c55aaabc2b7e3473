"""memfit.clip_grad_norm_ in one process (a gloo group of one): torch.nn.utils.clip_grad_norm_
is the reference (same norm to fp32 rounding, same clipped gradients), and the aten ops it
issues do not grow with the number of gradients (foreach ops, as torch's own)."""

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit


class Ops(TorchDispatchMode):
    """How many aten ops ran (views and the like included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def stack(layers: int, dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(layers)
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)], nn.LayerNorm(6)).to(dtype)


def sharded(model: nn.Sequential) -> nn.Sequential:
    for block in list(model)[:-1]:
        memfit.shard(block)
    return memfit.shard(model)


def backward(model: nn.Module) -> None:
    model(torch.randn(5, 6, dtype=next(model.parameters()).dtype)).pow(2).sum().backward()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_same_norm_and_gradients_as_torch(norm_type):
    ref = stack(4)
    model = sharded(copy.deepcopy(ref))
    torch.manual_seed(0)
    backward(ref)
    torch.manual_seed(0)
    backward(model)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type).item()
    got = memfit.clip_grad_norm_(model, 0.01, norm_type)
    # fp32 norms of fp32 gradients combined in another order: a few fp32 roundings apart
    assert got == pytest.approx(want, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.reshape(-1), q.grad.reshape(-1), rtol=1e-6, atol=0, msg=name)


def test_bf16_gradients_take_an_fp32_norm():
    ref = stack(3, torch.bfloat16)
    model = sharded(copy.deepcopy(ref))
    torch.manual_seed(0)
    backward(ref)
    torch.manual_seed(0)
    backward(model)
    want = torch.linalg.vector_norm(torch.cat([q.grad.float().reshape(-1) for q in ref.parameters()])).item()
    assert memfit.clip_grad_norm_(model, 1e9) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_op_count_does_not_grow_with_the_number_of_gradients(norm_type):
    counts = []
    for layers in (2, 8):
        model = sharded(stack(layers))
        backward(model)
        with Ops() as ops:
            memfit.clip_grad_norm_(model, 1e-3, norm_type)  # small: the gradients are scaled
        assert ops.count["aten._foreach_mul_"] == 1
        counts.append(ops.count)
    assert counts[0] == counts[1]
