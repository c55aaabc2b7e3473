"""memfit checkpointing under torch.compile: the same loss and gradients as eager (bitwise:
the compiled graphs compute the same ops, and inductor draws dropout masks with eager's RNG
under fallback_random), recompute really happens in the compiled backward, no more graph
breaks than torch.utils.checkpoint, and offload refused with a clear error."""

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import memfit


class Block(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.l1, self.l2, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(p)

    def forward(self, x):
        return x + self.l2(self.drop(torch.relu(self.l1(x))))


class TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return tuc.checkpoint(self.block, x, use_reentrant=False)


def build(n: int = 3, p: float = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(p) for _ in range(n)])


def step(model: nn.Module, call=None) -> tuple[float, torch.Tensor]:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    loss = (call or model)(x).sum()
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        yield
    torch._dynamo.reset()


def _whole(backend, save=None):
    m = build()
    memfit.apply_activation_checkpointing(m, Block, save=save)
    return step(m, torch.compile(m, backend=backend))


def _per_block_after(backend):  # torchtitan's order: checkpoint, then compile each block
    m = build()
    memfit.apply_activation_checkpointing(m, Block)
    for i in range(len(m)):
        m[i] = torch.compile(m[i], backend=backend)
    return step(m)


def _per_block_before(backend):  # compile each block in place, then checkpoint
    m = build()
    for b in m:
        b.compile(backend=backend)
    memfit.apply_activation_checkpointing(m, Block)
    return step(m)


def _eager_checkpoint_of_compiled(backend):
    m = build()
    compiled = [torch.compile(b, backend=backend) for b in m]

    def call(x):
        for c in compiled:
            x = memfit.checkpoint(c, x)
        return x

    return step(m, call)


@pytest.mark.parametrize(
    ("backend", "how"),
    [
        ("aot_eager", _whole),
        ("aot_eager", lambda b: _whole(b, save="linear")),
        ("aot_eager", _per_block_after),
        ("aot_eager", _per_block_before),
        ("aot_eager", _eager_checkpoint_of_compiled),
        ("inductor", _whole),
        ("inductor", _per_block_after),
    ],
    ids=[
        "whole",
        "whole-selective",
        "per-block-after",
        "per-block-before",
        "eager-of-compiled",
        "ind-whole",
        "ind-block",
    ],
)
def test_compiled_matches_eager_bitwise(backend, how):
    ref_loss, ref_grads = step(build())
    loss, grads = how(backend)
    assert loss == ref_loss
    assert torch.equal(grads, ref_grads)


def _backward_flops(model: nn.Module) -> int:
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    out = compiled(x).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops()


def test_compiled_backward_recomputes_and_honours_save():
    """Named arithmetic: each Linear's backward is 2 matmuls (weight and input gradients)
    except the first Linear's input gradient (x needs none); full recompute adds each block's
    first forward matmul (l1's output feeds relu and l2, whose backward need it; l2's output is
    saved by nothing, so it is not recomputed); save="linear" keeps l1's output (no recompute)."""
    plain = _backward_flops(build(p=0.0))
    full = build(p=0.0)
    memfit.apply_activation_checkpointing(full, Block)
    selective = build(p=0.0)
    memfit.apply_activation_checkpointing(selective, Block, save="linear")
    n, b, d, h = 3, 4, 16, 32  # blocks, batch, width, hidden
    matmul = 2 * b * d * h  # one Linear's matmul: 2 flops per multiply-add
    assert plain == (2 * 2 * n - 1) * matmul
    recomputed = n * matmul
    assert _backward_flops(full) == plain + recomputed
    assert _backward_flops(selective) == plain


def _breaks(model: nn.Module) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(4, 16))
    return explained.graph_count, explained.graph_break_count


def test_no_more_graph_breaks_than_torch():
    ours = build()
    memfit.apply_activation_checkpointing(ours, Block)
    theirs = build()
    for i in range(len(theirs)):
        theirs[i] = TorchCheckpointed(theirs[i])
    assert _breaks(ours) == _breaks(theirs) == (1, 0)


def test_offload_under_compile_runs_eagerly(tmp_path):
    """An offloaded block stays out of the graph (memfit's eager hooks move its inputs): the
    same gradients as eager, at the cost of a graph break on each side of it."""
    ref_loss, ref_grads = step(build())
    m = build()
    memfit.apply_activation_checkpointing(m, Block, offload=memfit.Offload("disk", directory=str(tmp_path)))
    loss, grads = step(m, torch.compile(m, backend="aot_eager"))
    assert loss == ref_loss
    assert torch.equal(grads, ref_grads)
