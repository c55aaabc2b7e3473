"""The planner profiles identical blocks once: a block whose class, structure, parameter and
buffer shapes and dtypes, inputs and forward in the measured step all match one profiled
before reuses its profile; a block that differs in any of them is profiled on its own (see
[Note: Planning on fake tensors]). Counts only (ModelProfile.distinct_blocks: the blocks
profiled), no timings."""

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
    assert distinct(Net([Block() for _ in range(4)], biases=[3, 3, 3, 3])) == 1


def test_blocks_that_differ_in_anything_are_each_profiled_on_their_own():
    frozen, buffer = Block(), Block()
    frozen.fc2.weight.requires_grad_(False)  # a parameter trainable or not
    buffer.scale = torch.ones(1)  # a buffer of another shape (it broadcasts: the same ops)
    odd = [
        Block(hidden=48),  # a parameter's shape
        Block(dtype=torch.float64),  # the dtypes
        Renamed(),  # the class, with Block's forward and shapes
        Block(gated=True),  # a plain attribute (not in the repr) that changes the forward
        frozen,
        buffer,
        Block(),  # given an input of another shape (below)
    ]
    net = Net([Block(), Block(), *odd, Block()], biases=[3, 3, 3, 3, 3, 3, 3, 3, 5, 3])
    assert distinct(net) == 1 + len(odd)  # every odd one alone; the three plain ones once
