"""The planner profiles identical blocks once: a block whose class, structure, parameter and
buffer shapes and dtypes, inputs and forward in the measured step all match one profiled
before reuses its profile; a block that differs in any of them is profiled on its own (see
[Note: Planning on fake tensors]). Counts only (ModelProfile.distinct_blocks: the blocks
profiled), no timings."""

import pytest
import torch
from torch import nn

from memfit._plan._profile import profile_model


class Block(nn.Module):
    def __init__(self, width=16, hidden=32, gated=False, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, width, dtype=dtype)
        self.gated = gated  # a plain attribute: not in the module's repr
        self.register_buffer("scale", torch.ones(width, dtype=dtype))

    def forward(self, x, bias=None):
        h = torch.relu(self.fc1(x.to(self.fc1.weight.dtype)))
        if self.gated:
            h = h * torch.sigmoid(h)
        out = self.fc2(h) * self.scale
        if bias is not None:
            out = out + bias.sum()
        return x + out.to(x.dtype)


class Renamed(Block):
    """Block's forward and shapes under another class."""


class Net(nn.Module):
    def __init__(self, blocks, biases=None):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.layers = nn.ModuleList(blocks)
        self.biases = biases  # per block: the size of the extra input it is given, or None

    def forward(self, x):
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            size = None if self.biases is None else self.biases[i]
            h = layer(h, None if size is None else torch.ones(size, device=h.device))
        return h.square().mean()


def distinct(net):
    profile = profile_model(net, (torch.randn(4, 8),), [(f"layers.{i}", b) for i, b in enumerate(net.layers)],
                            loss_fn=lambda out: out, chunk_head=False)  # fmt: skip
    assert len(profile.blocks) == len(net.layers)
    return profile.distinct_blocks


def test_identical_blocks_are_profiled_once():
    assert distinct(Net([Block() for _ in range(4)])) == 1
    assert distinct(Net([Block() for _ in range(4)], biases=[3, 3, 3, 3])) == 1


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda: Block(hidden=48), id="parameter shape"),
        pytest.param(lambda: Block(dtype=torch.float64), id="dtype"),
        pytest.param(Renamed, id="class"),
        pytest.param(lambda: Block(gated=True), id="attribute that changes the forward"),
    ],
)
def test_a_block_that_differs_is_profiled_on_its_own(odd):
    assert distinct(Net([Block(), Block(), odd(), Block()])) == 2


def test_a_block_given_other_input_shapes_is_profiled_on_its_own():
    assert distinct(Net([Block() for _ in range(4)], biases=[3, 3, 5, 3])) == 2


def test_a_buffer_of_another_shape_is_profiled_on_its_own():
    odd = Block()
    odd.scale = torch.ones(1)  # broadcasts: the same ops, another buffer
    assert distinct(Net([Block(), odd, Block(), Block()])) == 2


def test_a_block_that_differs_in_a_parameter_trainable_or_not_is_profiled_on_its_own():
    odd = Block()
    odd.fc2.weight.requires_grad_(False)
    assert distinct(Net([Block(), Block(), Block(), odd])) == 2
