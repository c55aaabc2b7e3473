"""The profile under mixed precision: the skeleton cast as memfit's units compute, the optimizer
stepping on shards in their own dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit._plan._step import _make_optimizer, _Meter
from memfit._plan._step_profile import _WholeStep
from memfit._plan._time import CostRecorder
from memfit._shard._mixed import MixedPrecision


# [Note: Forecasts under mixed precision]
# memfit.MixedPrecision (FSDP2's MixedPrecisionPolicy) keeps the shards, their gradients and the
# optimizer state in the parameters' own dtype (fp32 master weights), and computes on full
# parameters cast to param_dtype (norm layers in fp32 by default): a unit's gathered copy, its
# activations and the gradients its backward makes are in the compute dtype; the gradients are
# copied into a reduce buffer of the reduce dtype and reduce-scattered into fp32 shards. So the
# profile measures the step on a skeleton cast as the units compute (parameters to their
# compute dtype, buffers and norm layers as MixedPrecision.prepare leaves them, the floating
# inputs of the model and of each block cast to param_dtype, as a unit's pre-forward does), and
# the optimizer step on fake shards in their own dtype with gradients in it. The forecast then
# holds, per rank: the shards and optimizer state at 1/s (S); the units' compute copies as
# gathered buffers at any shard count (one rank too: the copy is made each forward); the
# gradients made in the compute dtype until their unit's reduce; the reduce buffer at
# reduce_scale and the shard at grad_shard_scale of those bytes (one ratio over the whole
# model: a norm layer's fp32 gradient among bf16 ones moves it by its share of the bytes).
# Replicated layouts of W > 1 ranks (memfit's (W, 1) units) are forecast where gradients are
# summed in fp32 (reduce_dtype=torch.float32, as memfit train's --mixed-precision bf16): under
# no_sync the micro-batches' gradients accumulate in fp32 accumulators, which the accumulated
# gradients of autoconfigure's held_gradients count (fp32, whole). 2 gloo ranks of BERT, GPT-2
# and Llama (and 4 of BERT and Llama) at 4 x 1, 2 x 2 and 1 x 4 measured 0.94 to 0.998x their
# forecast. Summed in
# bf16 (reduce_dtype=None) the units hold them otherwise (a Llama at 1 x 4 measured 1.03x its
# forecast): refused by memfit.plan, left out by autoconfigure.
def _compute_as(skeleton: nn.Module, mp: MixedPrecision) -> list[tuple[nn.Parameter, torch.dtype]]:
    """Cast ``skeleton`` as memfit's units compute under ``mp`` (see [Note: Forecasts under
    mixed precision]); returns each trainable parameter of the cast skeleton with the dtype its
    shard keeps (its own before the cast)."""
    cast: dict[int, nn.Parameter] = {}
    masters = []
    for m in skeleton.modules():
        dtype = mp.compute_dtype(m)
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in cast:  # a tied parameter takes its first module's dtype, as a unit's chunk does
                new = p
                if p.is_floating_point() and p.dtype != dtype:
                    new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                cast[id(p)] = new
                if p.requires_grad:
                    masters.append((new, p.dtype))
            m._parameters[name] = cast[id(p)]
    mp.prepare(list(skeleton.modules()))
    skeleton.register_forward_pre_hook(_inputs_to(mp.param_dtype), with_kwargs=True)
    return masters


def _inputs_to(dtype: torch.dtype) -> Callable:
    """A forward pre-hook casting floating inputs to ``dtype``, as a unit's pre-forward does."""

    def to(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module, args, kwargs):
        return tree_map(to, args), tree_map(to, kwargs)

    return hook


def _master_step(
    whole: _WholeStep, masters: list[tuple[nn.Parameter, torch.dtype]], optimizer: str, buffers: int
) -> _WholeStep:
    """``whole`` (a step measured without optimizer) with the optimizer's state, peak and ops
    over shards in their own dtype: one step to create the state, one measured, each parameter
    the step gave a gradient holding one of its shard's dtype; the model's ``buffers`` bytes
    alive beside (the peak of a step measured with the optimizer counts them)."""
    used = [(p, dtype) for p, dtype in masters if id(p) in whole.used]
    shards = nn.ParameterList([nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device)) for p, dtype in used])
    for p in shards:
        p.grad = torch.zeros_like(p)
    opt = _make_optimizer(optimizer, shards)
    opt.step()
    with _Meter(model=shards, optimizer=opt) as meter, CostRecorder() as recorder:
        opt.step()
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    costs = [*whole.forward_backward, *recorder.costs]
    peak = meter.peak_bytes + buffers
    return dataclasses.replace(whole, optimizer_bytes=state, optimizer_peak=peak, costs=costs)


def _mixed_terms(masters, blocks: list[nn.Module], mp: MixedPrecision, master: int) -> dict[str, Any]:
    """ModelProfile's mixed-precision fields (see [Note: Forecasts under mixed precision]): a
    unit's reduce dtype is mp.reduce_dtype, or its gradients' one dtype, or fp32 where it mixes
    dtypes (fp32 norm layers among bf16 ones), as memfit's reduce buffer takes it."""
    owner: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner.setdefault(id(p), i)
    units: dict[int, list[nn.Parameter]] = {}
    for p, _ in masters:
        units.setdefault(owner.get(id(p), -1), []).append(p)  # -1: the root
    made = reduced = 0
    for params in units.values():
        dtype = _reduce_dtype(params, mp)
        made += sum(p.numel() * p.element_size() for p in params)
        reduced += sum(p.numel() * dtype.itemsize for p in params)
    shard = sum(p.numel() * dt.itemsize for p, dt in masters)
    computed = f"{str(mp.param_dtype).removeprefix('torch.')} compute"
    return {
        "master_bytes": master,
        "grad_shard_scale": shard / made if made else 1.0,
        "reduce_scale": reduced / made if made else 1.0,
        "compute": computed + (", torch.nn norm layers in float32" if mp.keep_norms_fp32 else ""),
    }


def _reduce_dtype(params: list[nn.Parameter], mp: MixedPrecision | None) -> torch.dtype:
    """The dtype a unit of ``params`` reduces in: mp.reduce_dtype, else its gradients' one
    dtype, else fp32 (fp32 norm layers among bf16 ones), as memfit's reduce buffer takes it."""
    dtypes = {p.dtype for p in params}
    if mp is not None and mp.reduce_dtype is not None:
        return mp.reduce_dtype
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
