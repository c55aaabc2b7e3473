"""One step on the example batch, as the profile runs it: the model called, its loss, an optimizer,
and the byte counts, copies and meter that the measurements share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from memfit._checkpoint._cache import cache_type, snapshot_caches
from memfit.memory import MemoryMeter


def _tensor_bytes(obj) -> int:
    seen, total = set(), 0
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            total += t.untyped_storage().nbytes()
    return total


def _state_bytes(module: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in [*module.parameters(), *module.buffers()])


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.untyped_storage().nbytes() for b in module.buffers())


def _fresh(args, kwargs):
    """Copies of a block's arguments: tensors cloned, a transformers Cache snapshot (as a
    checkpointed call's recompute sees it: [Note: Key/value caches under recompute])."""
    cache = cache_type()

    def clone(t):
        if cache is not None and isinstance(t, cache):
            return snapshot_caches([t])[0]
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad)

    return tree_map(clone, args), tree_map(clone, kwargs)


def _outputs_with_grad(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


Inputs = dict | tuple | list | torch.Tensor


def call(model: nn.Module, inputs: Inputs):
    """``model`` on an example batch: a dict as keyword arguments, a tuple or list as positional
    arguments, a tensor as the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    raise TypeError(
        f"memfit.plan: example inputs must be a dict (keyword arguments), a tuple or list (positional "
        f"arguments) or a tensor, got {type(inputs).__name__}"
    )


def step_loss(model: nn.Module, inputs: Inputs, loss_fn: Callable | None = None) -> torch.Tensor:
    """The loss of one forward: ``loss_fn(output)`` when given, else the output's ``.loss`` (or
    ``["loss"]``), else the output itself when it is a scalar tensor."""
    out = call(model, inputs)
    if loss_fn is not None:
        return loss_fn(out)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if loss is None:
        what = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"memfit.plan: {type(model).__name__} returned {what} and no loss; pass loss_fn=callable(output) -> "
            "scalar loss (e.g. cross-entropy of the logits against your labels), or inputs that make the model "
            "return one (HF models: labels=...)"
        )
    return loss


class _Meter(MemoryMeter):
    """MemoryMeter without the breakdown by category at each new peak (the planner reads the
    totals only; naming the categories costs O(live tensors) per peak)."""

    def _categorise(self) -> dict[str, int]:
        return {}

    def entries(self) -> dict[int, tuple]:
        """The live storages now: key -> the meter's entry (a new entry for a reused key)."""
        self._sweep()
        return dict(self._live)


def _make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params)
    if name == "adam":
        return torch.optim.Adam(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(f"memfit.plan: unknown optimizer {name!r}; choose 'adamw', 'adam' or 'sgd'")
