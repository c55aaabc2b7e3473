"""memfit.checkpoint: parity with the plain function, bitwise on CPU fp32 (dropout included)."""

import copy

import pytest
import torch
from torch import nn

import memfit
import memfit.testing
from memfit import CheckpointError
from tests._models import tanh_blocks
from tests._parity import assert_same, grads


def mlp(h=16, p=0.25):
    return nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Dropout(p), nn.Linear(h, h), nn.Tanh())


def run(block, x, use_ckpt, seed=1):
    torch.manual_seed(seed)
    y = memfit.checkpoint(block, x) if use_ckpt else block(x)
    y.square().sum().backward()
    return y


def test_parity_bitwise_with_dropout():
    ref = mlp()
    ck = copy.deepcopy(ref)
    x = torch.randn(4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y_ref = run(ref, xr, False)
    y = run(ck, x, True)
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, xr.grad)
    assert_same(grads(ck), grads(ref))


def test_rng_stream_after_backward_is_unchanged():
    block = mlp()
    x = torch.randn(4, 16, requires_grad=True)
    run(block, x, True, seed=3)
    after_ckpt = torch.rand(3)
    run(block, x, False, seed=3)
    after_plain = torch.rand(3)
    assert torch.equal(after_ckpt, after_plain)


def test_recomputes_once_per_backward_and_not_without_grad():
    calls = []

    def f(x, w):
        calls.append(memfit.is_recomputing())
        return (x @ w).sin()

    w = torch.randn(3, 3, requires_grad=True)
    memfit.checkpoint(f, torch.randn(2, 3), w).sum().backward()
    assert calls == [False, True]
    assert w.grad is not None

    calls.clear()
    out = memfit.checkpoint(f, torch.randn(2, 3), w.detach())  # nothing needs grad
    assert not out.requires_grad and calls == [False]

    calls.clear()
    with torch.no_grad():
        memfit.checkpoint(f, torch.randn(2, 3), w)
    with torch.inference_mode():
        memfit.checkpoint(f, torch.randn(2, 3), w)
    assert calls == [False, False]
    assert not memfit.is_recomputing()


def test_kwargs_nested_structures_and_non_tensor_outputs():
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)

    def f(module, x, *, extra, scale=1.0, tag=None):
        a, (b, c) = extra["pair"], extra["nested"]
        y = module(x) * scale + a * b.sum() - c
        return {"y": y, "aux": [y.exp(), tag], "n": 3}

    def inputs():
        torch.manual_seed(7)
        x = torch.randn(2, 4, requires_grad=True)
        extra = {"pair": torch.randn(4, requires_grad=True), "nested": (torch.randn(4), torch.randn(2, 4))}
        return x, extra

    x, extra = inputs()
    out = memfit.checkpoint(f, lin, x, extra=extra, scale=2.0, tag="t")
    (out["y"].sum() + out["aux"][0].sum()).backward()
    xr, extra_r = inputs()
    out_r = f(ref, xr, extra=extra_r, scale=2.0, tag="t")
    (out_r["y"].sum() + out_r["aux"][0].sum()).backward()
    assert out["aux"][1] == "t" and out["n"] == 3
    assert torch.equal(out["y"], out_r["y"])
    assert torch.equal(x.grad, xr.grad) and torch.equal(extra["pair"].grad, extra_r["pair"].grad)
    assert_same(grads(lin), grads(ref))


def test_inputs_without_grad_still_give_parameter_grads():
    block = mlp(p=0.0)
    x = torch.randn(4, 16)  # no requires_grad: torch's reentrant checkpoint returns no grads here
    y = memfit.checkpoint(block, x)
    assert y.requires_grad
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


def test_outputs_that_need_no_grad_pass_through():
    lin = nn.Linear(3, 3)

    def f(x):
        return lin(x), x.argmax(-1), x.detach() * 2

    y, idx, det = memfit.checkpoint(f, torch.randn(2, 3, requires_grad=True))
    assert y.requires_grad and not idx.requires_grad and not det.requires_grad
    y.sum().backward()
    assert lin.weight.grad is not None


def test_nested_checkpoints_match_plain():
    inner1, inner2 = mlp(), mlp()
    ref1, ref2 = copy.deepcopy(inner1), copy.deepcopy(inner2)

    def outer(x, a, b, use):
        h = memfit.checkpoint(a, x) if use else a(x)
        return (memfit.checkpoint(b, h) if use else b(h)) + h

    x = torch.randn(4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    torch.manual_seed(5)
    memfit.checkpoint(outer, x, inner1, inner2, True).sum().backward()
    torch.manual_seed(5)
    outer(xr, ref1, ref2, False).sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert_same(grads(inner1) + grads(inner2), grads(ref1) + grads(ref2))


def test_autocast_state_is_replayed():
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(block)
    x = torch.randn(4, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = memfit.checkpoint(block, x)
        yr = ref(xr)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()  # backward (and recompute) outside autocast
    yr.float().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert_same(grads(block), grads(ref))


def test_batchnorm_running_stats_updated_once():
    block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())
    ref = copy.deepcopy(block)
    for _ in range(3):
        x = torch.randn(8, 6, requires_grad=True)
        memfit.checkpoint(block, x).sum().backward()
        ref(x.detach().requires_grad_()).sum().backward()
    bn, bn_ref = block[1], ref[1]
    assert torch.equal(bn.running_mean, bn_ref.running_mean)
    assert torch.equal(bn.running_var, bn_ref.running_var)
    assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == 3
    assert_same(grads(block), grads(ref))


def test_retain_graph_second_backward_recomputes():
    block = mlp()
    ref = copy.deepcopy(block)
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(2)
    y = memfit.checkpoint(block, x)
    torch.manual_seed(2)
    yr = ref(x)
    for out in (y, yr):
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    assert_same(grads(block), grads(ref))


def test_recomputed_graph_is_freed_after_backward():
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    y = memfit.checkpoint(block, torch.randn(2, 4, requires_grad=True))
    y.sum().backward()  # y (and its graph) stays alive; the frame must not
    assert memfit.testing.live_checkpoint_frames() == 0


def test_partial_backward_passes_do_not_accumulate_recomputed_tensors():
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh())
    y = memfit.checkpoint(block, torch.randn(4, 8, requires_grad=True))
    for _ in range(3):  # each pass reaches only the block's tail, and recomputes all of it
        torch.autograd.grad(y.sum(), [block[2].bias], retain_graph=True)
        assert memfit.testing.held_recomputed_tensors() == []


def test_block_called_twice_with_shared_weights():
    lin = nn.Linear(5, 5)
    ref = copy.deepcopy(lin)
    x = torch.randn(3, 5, requires_grad=True)
    memfit.checkpoint(lin, memfit.checkpoint(lin, x).tanh()).sum().backward()
    ref(ref(x).tanh()).sum().backward()
    assert_same(grads(lin), grads(ref))


def test_disable_checkpointing_runs_plainly():
    calls = []

    def f(x):
        calls.append(1)
        return x.sin()

    with memfit.disable_checkpointing():
        memfit.checkpoint(f, torch.randn(3, requires_grad=True)).sum().backward()
    assert len(calls) == 1


# -- memory --------------------------------------------------------------------------------


def test_forward_peak_is_block_inputs_plus_one_block():
    # n blocks of depth d (Linear without bias, then Tanh); batch x h activations, fp32.
    n, d, batch, h = 3, 4, 16, 32
    blocks = tanh_blocks(n, d, h)
    x = torch.randn(batch, h, requires_grad=True)
    act = batch * h * 4
    weights = n * d * h * h * 4

    def peak(use_ckpt):
        with memfit.MemoryMeter() as meter:
            y = x
            for b in blocks:
                y = memfit.checkpoint(b, y) if use_ckpt else b(y)
        return meter.peak_bytes

    # Plain: x and every Tanh output are saved for backward (Tanh saves its result, Linear
    # its input, which is the previous Tanh output); at the last Tanh its Linear output is
    # alive too.
    assert peak(False) == weights + act * (1 + n * d) + act
    # Checkpointed: only the block inputs (x and the outputs of blocks 0..n-2) and the last
    # output are kept; inside the last block one Linear output and its Tanh are alive.
    assert peak(True) == weights + act * n + act * 2


# -- errors --------------------------------------------------------------------------------


def test_recompute_mismatch_names_the_function():
    state = {"n": 4}

    def unstable(x):
        y = x[: state["n"]].exp()
        state["n"] -= 1
        return y

    y = memfit.checkpoint(unstable, torch.randn(6, requires_grad=True))
    with pytest.raises(CheckpointError, match=r"unstable.*diverged.*float32\[4\].*float32\[3\]"):
        y.sum().backward()


def test_recompute_with_fewer_saved_tensors_is_an_error():
    state = {"deep": True}

    def shrinking(x):
        y = x.exp()
        if state["deep"]:
            y = y.exp()
        state["deep"] = False
        return y

    y = memfit.checkpoint(shrinking, torch.randn(3, requires_grad=True))
    with pytest.raises(CheckpointError, match=r"shrinking.*recompute saved 1 tensors.*forward saved 2"):
        y.sum().backward()


def test_inplace_input_mutation_is_an_error():
    def mutate(x):
        x.mul_(2)
        return x.exp()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"mutate.*input #0.*modified in place"):
        memfit.checkpoint(mutate, x * 1)


def test_non_callable_and_bad_offload():
    with pytest.raises(TypeError, match="expected a callable"):
        memfit.checkpoint(3, torch.randn(2))
    with pytest.raises(ValueError, match="unknown offload target 'gpu'"):
        memfit.checkpoint(torch.sin, torch.randn(2, requires_grad=True), offload="gpu")


def test_cpu_offload_on_cpu_is_exact():
    block = mlp()
    ref = copy.deepcopy(block)
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(1)
    memfit.checkpoint(block, x, offload="cpu").sum().backward()
    torch.manual_seed(1)
    ref(x.detach()).sum().backward()
    assert_same(grads(block), grads(ref))
