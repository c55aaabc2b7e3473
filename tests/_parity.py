"""What parity tests compare: gradients bitwise, and a rank's rows of a full tensor."""

import torch


def grads(module):
    """A copy of every parameter's gradient (None where there is none), in ``parameters()`` order."""
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_same(a, b):
    """Two lists of gradients are equal bitwise, None where the other is None."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), (x - y).abs().max()


def my_rows(t, rank, world):
    """This rank's dim-0 chunk of a full tensor (torch.chunk semantics; 0-dim = one row)."""
    rows = t.reshape(1) if t.dim() == 0 else t
    chunks = rows.chunk(world)
    return chunks[rank] if rank < len(chunks) else rows[:0]
