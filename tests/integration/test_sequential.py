"""memfit.checkpoint_sequential: segments, multi-value stages, errors."""

import copy

import pytest
import torch
from torch import nn

import memfit
from tests._parity import assert_same, grads


class Split(nn.Module):
    """Takes one tensor, returns two."""

    def __init__(self, h):
        super().__init__()
        self.a, self.b = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x):
        return self.a(x).relu(), self.b(x).tanh()


class Merge(nn.Module):
    """Takes two tensors, returns two (the second passes through)."""

    def __init__(self, h):
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, skip):
        return self.drop(self.fc(x)) + skip, skip


def stages(h=8):
    return nn.Sequential(Split(h), Merge(h), Merge(h), Merge(h), Merge(h))


def run(seq, x, segments=None):
    torch.manual_seed(4)
    if segments is None:
        out = x
        for s in seq:
            out = s(*out) if isinstance(out, tuple) else s(out)
    else:
        out = memfit.checkpoint_sequential(seq, segments, x)
    loss = out[0].square().sum() + out[1].sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_parity_with_multi_value_stages(segments):
    ref = stages()
    seq = copy.deepcopy(ref)
    x = torch.randn(4, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    assert torch.equal(run(seq, x, segments), run(ref, xr))
    assert torch.equal(x.grad, xr.grad)
    assert_same(grads(seq), grads(ref))


def test_list_of_functions_and_several_inputs():
    lin = nn.Linear(3, 3)
    fns = [lambda a, b: (lin(a) * b, b), lambda a, b: a + b, torch.sin]
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3)
    memfit.checkpoint_sequential(fns, 2, a, b).sum().backward()
    g = lin.weight.grad.clone()
    lin.weight.grad = None
    torch.sin(lin(a) * b + b).sum().backward()
    assert torch.equal(g, lin.weight.grad)


def test_segment_errors():
    seq = stages()
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"between 1 and the number of stages \(5\), got 0"):
        memfit.checkpoint_sequential(seq, 0, x)
    with pytest.raises(ValueError, match=r"between 1 and the number of stages \(5\), got 6"):
        memfit.checkpoint_sequential(seq, 6, x)
    with pytest.raises(TypeError, match="stage 1 is not callable"):
        memfit.checkpoint_sequential([torch.sin, 4], 1, x)
