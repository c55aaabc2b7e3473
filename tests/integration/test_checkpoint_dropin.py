"""memfit.checkpoint as a drop-in for torch.utils.checkpoint: the inputs recompute sees, and
torch's keywords. Each case compares with plain torch (bitwise: the arithmetic is the same)."""

import copy
import functools
import typing

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import memfit


def grads_of(module, x, fn):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    fn(x).sum().backward()
    return [x.grad, *[p.grad for p in module.parameters()]]


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_same_tensor_passed_several_times_is_one_object_in_recompute():
    attn = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    plain = grads_of(attn, x, lambda x: attn(x, x, x)[0])
    ckpt = grads_of(attn, x, lambda x: memfit.checkpoint(attn, x, x, x)[0])
    assert_same(ckpt, plain)


def test_python_attributes_on_inputs_survive_recompute():
    lin = nn.Linear(4, 4)

    def block(x, mask):
        return torch.tanh(lin(x * mask.scale)) * mask

    mask = torch.ones(3, 4)
    mask.scale = 2.0
    x = torch.randn(3, 4)
    plain = grads_of(lin, x, lambda x: block(x, mask))
    ckpt = grads_of(lin, x, lambda x: memfit.checkpoint(block, x, mask))
    assert_same(ckpt, plain)


class _SavesMask(torch.autograd.Function):
    seen: typing.ClassVar[dict] = {}

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        _SavesMask.seen["backward"] = mask
        return grad * mask, None


def test_input_needing_no_grad_is_the_same_object_in_backward():
    x, mask = torch.randn(3, requires_grad=True), torch.randn(3)
    memfit.checkpoint(_SavesMask.apply, x, mask).sum().backward()
    assert _SavesMask.seen["backward"] is mask  # as torch.utils.checkpoint gives it
    assert torch.equal(x.grad, mask)


def test_torch_keywords_are_not_passed_to_the_function():
    def f(x):  # takes no keywords: torch's must not reach it
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    memfit.checkpoint(f, x, use_reentrant=False, determinism_check="default", debug=False).sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
    with pytest.raises(ValueError, match="always non-reentrant"):
        memfit.checkpoint(f, x, use_reentrant=True)
    with pytest.raises(ValueError, match="determinism_check"):
        memfit.checkpoint(f, x, determinism_check="strict")


def test_determinism_check_none_skips_the_shape_check():
    calls = []

    def shrinking(x):  # saves a tensor of another shape when re-run
        calls.append(1)
        return (x[: 4 - len(calls)] ** 2).sum() + (x**2).sum()

    with pytest.raises(memfit.CheckpointError, match="diverged"):
        memfit.checkpoint(shrinking, torch.randn(4, requires_grad=True)).backward()
    calls.clear()
    with pytest.raises(RuntimeError) as info:  # torch's own error from the mismatched tensor
        memfit.checkpoint(shrinking, torch.randn(4, requires_grad=True), determinism_check="none").backward()
    assert not isinstance(info.value, memfit.CheckpointError)


def test_context_fn_takes_torchs_selective_policy():
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    mods = nn.ModuleList([lin1, lin2])
    ran = []

    def block(x):
        ran.append(1)
        return lin2(torch.relu(lin1(x)))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    x = torch.randn(2, 8)
    plain = grads_of(mods, x, block)
    ours = grads_of(mods, x, lambda x: memfit.checkpoint(block, x, context_fn=context_fn))
    theirs = grads_of(mods, x, lambda x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn))
    assert_same(ours, plain)
    assert_same(theirs, plain)
    with pytest.raises(ValueError, match="not both"):
        memfit.checkpoint(block, x, save="linear", context_fn=context_fn)


def test_checkpoint_error_is_torchs():
    assert issubclass(memfit.CheckpointError, tuc.CheckpointError)
    with pytest.raises(tuc.CheckpointError):

        def mutate(x):
            x.add_(1)
            return x * 2

        memfit.checkpoint(mutate, torch.randn(2, requires_grad=True) * 1)


def test_apply_activation_checkpointing_check_fn():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    paths = memfit.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    assert paths == ["0", "2"]
    with pytest.raises(TypeError, match="exactly one"):
        memfit.apply_activation_checkpointing(model, nn.Linear, check_fn=lambda m: True)


def test_apply_activation_checkpointing_takes_torchs_signature():
    """torch's call, checkpoint_wrapper_fn included, checkpoints in place: the same gradients
    as torch's own wrappers (bitwise), parameter names unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh())
    x = torch.randn(3, 4)
    ref = copy.deepcopy(base)
    fn = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(ref, checkpoint_wrapper_fn=fn, check_fn=lambda m: isinstance(m, nn.Linear))
    for kwargs in (
        {"checkpoint_wrapper_fn": fn, "check_fn": lambda m: isinstance(m, nn.Linear)},
        {"checkpoint_wrapper_fn": checkpoint_wrapper, "auto_wrap_policy": ModuleWrapPolicy({nn.Linear})},
        {"checkpoint_wrapper_fn": memfit.checkpoint_wrapper, "check_fn": lambda m: isinstance(m, nn.Linear)},
    ):
        model = copy.deepcopy(base)
        assert memfit.apply_activation_checkpointing(model, **kwargs) == ["0", "2"]
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
        assert_same(grads_of(model, x, model), grads_of(ref, x, ref))
    model = copy.deepcopy(base)
    first = model[0]
    memfit.apply_activation_checkpointing(model, checkpoint_wrapper_fn=offload_wrapper, check_fn=lambda m: m is first)
    assert model[0].forward.offload is not None  # offload_wrapper: the kept tensors go to the host
    assert_same(grads_of(model, x, model), grads_of(ref, x, ref))


def test_apply_activation_checkpointing_custom_wrapper_replaces_the_module():
    """Any other checkpoint_wrapper_fn is called, and what it returns takes the module's place
    (torch's behaviour); memfit's offload=/save= do not combine with it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    paths = memfit.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=nn.Sequential, check_fn=lambda m: isinstance(m, nn.Linear)
    )
    assert paths == ["0"] and isinstance(model[0], nn.Sequential) and isinstance(model[0][0], nn.Linear)
    with pytest.raises(TypeError, match="offload= and save= apply to memfit's checkpointing"):
        memfit.apply_activation_checkpointing(model, checkpoint_wrapper_fn=lambda m: m, check_fn=bool, save="all")
