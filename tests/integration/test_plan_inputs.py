"""memfit.plan's inputs: batches as a dict, tuple or tensor, and the loss (loss_fn=, or a
clear error when the model returns none)."""

import pytest
import torch
from torch import nn

import memfit


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x, y=None):
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)


def test_tensor_tuple_and_dict_batches_give_the_same_plan():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss_fn = nn.functional.cross_entropy
    keep = {"budget": "1GB", "decisions": ("keep",)}  # memory only: timings would make plans differ
    by_tuple = memfit.plan(Net(), (x, y), **keep)
    by_dict = memfit.plan(Net(), {"x": x, "y": y}, **keep)
    by_tensor = memfit.plan(Net(), x, loss_fn=lambda logits: loss_fn(logits, y), **keep)
    memory = [{k: v for k, v in p.forecast.items() if k != "extra_time"} for p in (by_tuple, by_dict, by_tensor)]
    assert memory[0] == memory[1]
    # The labels a loss_fn closes over are not the batch: counted from the loss, not the step's
    # start ([Note: The batch from the step's start]); the same bytes, the same peak.
    moved = ("term:before_blocks", "term:head_transient")
    assert {k: v for k, v in memory[0].items() if k not in moved} == {
        k: v for k, v in memory[2].items() if k not in moved
    }
    assert sum(memory[0][k] for k in moved) == sum(memory[2][k] for k in moved)


def test_logits_without_a_loss_are_refused_with_what_to_pass():
    with pytest.raises(ValueError, match=r"returned a tensor of shape \[8, 4\] and no loss; pass loss_fn="):
        memfit.plan(Net(), torch.randn(8, 16), budget="1GB")


def test_unknown_batch_type_names_the_type_not_the_model():
    with pytest.raises(TypeError, match="got int") as info:
        memfit.plan(Net(), 3, budget="1GB")
    assert "Linear(" not in str(info.value)
