"""The no-extras check: run in a fresh virtual environment holding memfit with no extras.

`import memfit`, then in one process a checkpointed step and a plan applied and stepped. It
uses only what `pip install .` brings (torch and numpy), so a dependency the package needs
but does not declare fails here. Exits non-zero on any failure.
"""

import importlib.util
import sys

import torch
from torch import nn

import memfit

EXTRAS = ("transformers", "lightning", "rich", "matplotlib", "fairscale", "pytest", "yaml", "tokenizers")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def main() -> None:
    present = [name for name in EXTRAS if importlib.util.find_spec(name) is not None]
    if present:
        sys.exit(f"no_extras: this environment is not bare, it holds {present}: run it in a fresh venv")
    torch.manual_seed(0)
    x = torch.randn(1024, 32)  # activations outweigh the parameters: a plan has a choice

    # One checkpointed call: the same loss and gradients as the plain call (the same ops rerun
    # in the same order on the same inputs, so equal bitwise).
    ref = Net()
    ref(x).backward()
    model = Net()
    model.load_state_dict(ref.state_dict())
    block = model.layers[0]
    h = memfit.checkpoint(block, x)
    for layer in model.layers[1:]:
        h = layer(h)
    h.square().mean().backward()
    for a, b in zip(grads(ref), grads(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # A plan one byte under the unplanned step's peak (so not all keep), applied, one step, removed.
    unplanned = memfit.plan(Net(), x, budget="1GB")
    budget = unplanned.predicted_peak - 1
    p = memfit.plan(model, x, budget=budget)
    if p.predicted_peak > budget or set(p.decisions.values()) == {"keep"}:
        sys.exit(f"no_extras: plan {p.decisions} forecasts {p.predicted_peak} B for a budget of {budget} B")
    model.zero_grad()
    p.apply(model)
    model(x).backward()
    for a, b in zip(grads(ref), grads(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    p.unapply(model)
    print(f"no_extras: memfit {memfit.__version__} on torch {torch.__version__}: checkpoint and plan OK")
    print(p.table())


if __name__ == "__main__":
    main()
