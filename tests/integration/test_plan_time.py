"""The planner's step time, priced from fake tensors, against the same ops recorded on real
tensors: the same op list, FLOPs and bytes, and a decision priced as the ops it adds."""

import collections
import copy

import pytest
import torch
from torch import nn

import memfit
from memfit._plan._time import CostRecorder
from memfit.models import Shape, bert_mlm, mlm_batch

# Round numbers, with checkpoint's own cost: every term of the formula shows in a price.
FLAT = memfit.DeviceProfile("flat", {"float32": 1e9}, 1e9, 1e8, 1e-6, checkpoint_block=1e-4, checkpoint_op=2e-6)


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def real_ops(block: nn.Module, x: torch.Tensor, kind: str) -> list:
    """The ops of ``block``'s forward and backward on real tensors under decision ``kind``."""
    b = copy.deepcopy(block)
    memfit.Decision.parse(kind).apply(b)
    x = x.detach().requires_grad_()
    with CostRecorder() as rec:
        out = b(x)
    grad = torch.ones_like(out)
    with rec:
        out.backward(grad)
    return rec.costs


def test_a_decision_is_priced_as_the_ops_it_adds_on_real_tensors():
    model, x = Stack(), torch.randn(8, 16)
    plan = memfit.plan(model, (x,), loss_fn=lambda loss: loss, budget="1TB", device_profile=FLAT)
    # The second block: its input needs a gradient (the first's, the batch, does not).
    keep, full = real_ops(model.blocks[1], x, "keep"), real_ops(model.blocks[1], x, "full")
    added = collections.Counter(c.op for c in full) - collections.Counter(c.op for c in keep)
    # The recompute runs up to the last op whose output backward needs: up and gelu, not down.
    assert added["aten.addmm"] == 1 and added["aten.gelu"] == 1
    expected = FLAT.ops_time(full) - FLAT.ops_time(keep) + 1e-4 + 2e-6 * (len(full) - len(keep))
    extra = plan.profile.blocks[1].extra_time
    assert extra["full"] == pytest.approx(expected, rel=1e-12)  # fake tensors price what real ones run
    assert extra["full"] > FLAT.ops_time([c for c in keep if c.op == "aten.addmm"][:1])  # at least the recompute
    assert 0 < extra["selective"] < extra["full"]  # the Linear outputs kept: gelu alone recomputed
    # float64 sums of the same terms in another order: default rel 1e-6
    assert extra["offload"] == pytest.approx(extra["full"] + 2 * x.nbytes / 1e8)


def test_the_fake_step_records_the_real_steps_ops():
    """Every op of a real training step (forward, backward, AdamW), with its FLOPs and bytes, is
    in the fake profile's step, and nothing else: the planner's own copies of the blocks' inputs
    are not (they were priced into the step before)."""
    shape = Shape(layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=256, dropout=0.0)
    model, batch = bert_mlm(shape), mlm_batch(shape)
    plan = memfit.plan(model, batch, budget="1TB", device_profile=FLAT)
    real = copy.deepcopy(model)
    opt = torch.optim.AdamW(real.parameters())

    def step():
        real(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists, as in the planner's step
    with CostRecorder() as rec:
        step()
    # the same op costs summed in float64, maybe in another order: rel 1e-12
    assert plan.profile.step_time == pytest.approx(FLAT.ops_time(rec.costs), rel=1e-12)
    keep = memfit.Plan.fixed(dict.fromkeys(plan.decisions, "keep"), plan.profile)
    assert keep.predicted_step_time == plan.profile.step_time


def test_same_model_and_profile_price_the_same():
    model, x = Stack(), torch.randn(8, 16)
    a = memfit.plan(model, (x,), loss_fn=lambda loss: loss, budget="1TB", device_profile=FLAT)
    b = memfit.plan(model, (x,), loss_fn=lambda loss: loss, budget="1TB", device_profile=FLAT)
    assert [blk.extra_time for blk in a.profile.blocks] == [blk.extra_time for blk in b.profile.blocks]
    assert a.profile.step_time == b.profile.step_time
    assert a.profile.distinct_blocks == 2  # the first block's input needs no gradient: the others' do
