"""Selective recompute (save=...) and offload of kept tensors ("disk" on the CPU)."""

import copy
import errno
import gc
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
import memfit.testing
from tests._models import tanh_blocks, tiny_bert
from tests._parity import assert_same, grads

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] = self.counts.get(func.overloadpacket, 0) + 1
        return func(*args, **(kwargs or {}))


class FFN(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.down(nn.functional.gelu(self.up(x))))


def step(model, x, seed=5):
    torch.manual_seed(seed)
    loss = model(x).square().sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("save", ["linear", "matmul", "all", lambda op: True, lambda op: False])
def test_selective_parity_bitwise_with_dropout(save):
    ref = nn.Sequential(FFN(), FFN())
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(model, FFN, save=save)
    x = torch.randn(8, 16)
    assert torch.equal(step(model, x), step(ref, x))
    assert_same(grads(model), grads(ref))


@pytest.mark.parametrize("save", ["linear", "matmul"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_selective_hf_bert_bitwise(save, attn):
    from transformers.models.bert.modeling_bert import BertLayer

    ref = tiny_bert()
    ref.config._attn_implementation = attn
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(model, BertLayer, save=save)
    ids = torch.randint(0, 120, (2, 16))
    losses = []
    for m in (model, ref):
        torch.manual_seed(11)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(*losses)
    assert_same(grads(model), grads(ref))


@pytest.mark.parametrize(("save", "addmm_calls"), [(None, 4), ("linear", 2), ("all", 2)])
def test_saved_ops_are_not_recomputed(save, addmm_calls):
    model = nn.Sequential(FFN())
    memfit.apply_activation_checkpointing(model, FFN, save=save)
    with OpCounter() as c:
        step(model, torch.randn(4, 16))
    # Two Linear layers: 2 addmm in forward, 2 more if recompute runs them again (backward
    # itself uses mm, not addmm).
    assert c.counts[aten.addmm] == addmm_calls


def test_random_ops_are_recomputed_even_if_the_rule_keeps_them():
    model = nn.Sequential(FFN())
    memfit.checkpoint_module(model[0], save=lambda op: True)  # asks to keep every output
    with OpCounter() as c:
        step(model, torch.randn(4, 16))
    assert c.counts[aten.addmm] == 2  # kept: not run again
    assert c.counts[aten.bernoulli_] == 2  # dropout's draw ran again in recompute (replayed RNG)


@pytest.mark.parametrize(
    ("save", "kept_acts"),
    [
        # x, the up output (4), the GELU output (4), the dropout mask (1), the output (1)
        ("plain", 1 + 4 + 4 + 1 + 1),
        ("all", 1 + 4 + 4 + 1 + 1),
        # x and the output only
        (None, 1 + 1),
        # x, the outputs of both Linear layers (4 + 1), the output
        ("linear", 1 + 4 + 1 + 1),
        ("matmul", 1 + 4 + 1 + 1),
    ],
)
def test_bytes_kept_after_forward(save, kept_acts):
    b, h = 32, 16
    block = FFN(h)
    if save != "plain":
        memfit.checkpoint_module(block, save=save)
    x = torch.randn(b, h, requires_grad=True)
    act = b * h * 4  # one b x h activation, fp32
    weights = (h * 4 * h + 4 * h + 4 * h * h + h) * 4
    with memfit.MemoryMeter() as meter:
        y = block(x)
    assert meter.current_bytes == weights + act * kept_acts
    del y


def test_disk_offload_peak_falls_by_offloaded_inputs(tmp_path):
    n, d, batch, h = 6, 2, 16, 32
    blocks = tanh_blocks(n, d, h)
    refs = copy.deepcopy(blocks)
    x = torch.randn(batch, h, requires_grad=True)
    act = batch * h * 4
    weights = n * d * h * h * 4
    offload = memfit.Offload("disk", directory=str(tmp_path))

    def forward(bs, off):
        with memfit.MemoryMeter() as meter:
            y = x
            for blk in bs:
                y = memfit.checkpoint(blk, y, offload=off)
        return meter.peak_bytes, y

    peak_mem, y_mem = forward(refs, None)
    peak_disk, y_disk = forward(blocks, offload)
    # In memory: x and the outputs of blocks 0..n-2 kept as block inputs, plus inside the
    # last block one Linear output and its Tanh.
    assert peak_mem == weights + act * n + act * 2
    # On disk: the inputs of blocks 1..n-2 left memory; x (held by the caller) and the
    # current block's input stay.
    assert peak_disk == peak_mem - act * (n - 2)
    files = os.listdir(tmp_path)
    # One file per block input but x: a leaf that requires grad is kept (its owner holds it).
    assert len(files) == 1 and len(os.listdir(tmp_path / files[0])) == n - 1
    y_mem.sum().backward()
    g_mem = x.grad.clone()
    x.grad = None
    y_disk.sum().backward()
    assert torch.equal(g_mem, x.grad)
    assert_same([p.grad for b in blocks for p in b.parameters()], [p.grad for b in refs for p in b.parameters()])
    assert os.listdir(tmp_path / files[0]) == []  # each file is deleted once backward used it


def test_save_all_with_disk_offload_moves_everything_saved(tmp_path):
    ref = tiny_bert()
    model = copy.deepcopy(ref)
    from transformers.models.bert.modeling_bert import BertLayer

    memfit.apply_activation_checkpointing(
        model, BertLayer, save="all", offload=memfit.Offload("disk", directory=str(tmp_path))
    )
    ids = torch.randint(0, 120, (2, 16))
    peaks = []
    for m in (model, ref):
        torch.manual_seed(1)
        with memfit.MemoryMeter(model=m) as meter:
            m(input_ids=ids, labels=ids).loss.backward()
        peaks.append(meter.peak_bytes)
    assert peaks[0] < peaks[1]
    assert_same(grads(model), grads(ref))


def test_unknown_save_rule():
    with pytest.raises(ValueError, match=r"unknown save rule 'some'.*'linear'"):
        memfit.checkpoint(torch.sin, torch.randn(2, requires_grad=True), save="some")
    with pytest.raises(TypeError, match="save must be None"):
        memfit.checkpoint_module(nn.Linear(2, 2), save=3)


def test_unwritable_offload_directory_fails_before_forward(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match=r"cannot write to .*file"):
        memfit.checkpoint_module(nn.Linear(2, 2), offload=memfit.Offload("disk", directory=str(not_a_dir)))
    with pytest.raises(ValueError, match="cannot write to '/nonexistent/memfit'"):
        memfit.Offload("disk", directory="/nonexistent/memfit")
    assert os.listdir(tmp_path) == ["file"]
    with pytest.raises(ValueError, match="directory applies to target='disk' only"):
        memfit.Offload("cpu", directory=str(tmp_path))
    with pytest.raises(ValueError, match="unknown offload target 'tape'"):
        memfit.Offload("tape")


def test_disk_full_mid_forward(tmp_path, monkeypatch):
    model = nn.Sequential(*[FFN() for _ in range(4)])
    memfit.apply_activation_checkpointing(model, FFN, offload=memfit.Offload("disk", directory=str(tmp_path)))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 16)
    step(model, x)
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    calls = []

    def full_disk(path, t, real_write):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, t)

    with (
        memfit.testing.offload_writer(full_disk),
        pytest.raises(
            OSError, match=r"writing a saved tensor .* to .*memfit-offload-[^/]+/\d+\.bin failed: No space left"
        ),
    ):
        step(model, x)
    gc.collect()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert str(opt.state_dict()) == str(opt_before)
    (store,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / store) == []  # nothing left behind
    step(model, x)  # training goes on once there is space again
    assert all(p.grad is not None for p in model.parameters())


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


@pytest.mark.parametrize("save", ["linear", "matmul"])
def test_batchnorm_in_a_selective_block_trains_like_the_plain_block(save):
    # The running-statistics snapshot taken during recompute used to reach torch's
    # selective-checkpoint mode: "aten.clone.default encountered during backward".
    torch.manual_seed(0)
    ref = nn.Sequential(ConvBN(), ConvBN())
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(model, ConvBN, save=save)
    x = torch.randn(8, 16)
    assert torch.equal(step(model, x), step(ref, x))
    assert_same(grads(model), grads(ref))
    for a, b in zip(model.buffers(), ref.buffers()):
        assert torch.equal(a, b)  # running statistics updated once, as without checkpointing
    assert int(model[0].bn.num_batches_tracked) == 1


# Host cost per op (see [Note: The cost of selective recompute]): a selective block's rule is
# asked once per distinct op of the block, not once per op call, and the ready rules' answers
# are cached process-wide. torch's policy (memfit's eager path before) asked on every op call.
def test_callable_rule_is_asked_once_per_distinct_op():
    asked = []

    def keep_linear(op):
        asked.append(op)
        return op.overloadpacket in (aten.addmm, aten.mm)

    block = FFN()
    memfit.checkpoint_module(block, save=keep_linear)
    x = torch.randn(4, 16, requires_grad=True)
    with OpCounter() as c:
        block(x).sum().backward()
    assert len(asked) == len(set(asked))  # once per op: addmm, t, gelu, ... each asked once
    assert len(asked) < sum(c.counts.values())  # fewer than the op calls (addmm and t run twice)
    assert c.counts[aten.addmm] == 2  # and kept: not run again in recompute


def test_ready_rule_is_decided_once_per_op_per_process(monkeypatch):
    from memfit._checkpoint import _selective

    asked = []
    rule = _selective._READY["linear"]
    monkeypatch.setitem(_selective._READY, "linear", lambda op: asked.append(op) or rule(op))
    monkeypatch.setattr(_selective, "_READY_DECISIONS", {})
    model = nn.Sequential(FFN(), FFN())
    memfit.apply_activation_checkpointing(model, FFN, save="linear")
    step(model, torch.randn(4, 16))
    first = len(asked)
    assert first == len(set(asked))
    step(model, torch.randn(4, 16))  # the second step (and the second block) asks nothing
    assert len(asked) == first


def test_kept_outputs_are_used_by_one_backward_only():
    block = FFN()
    memfit.checkpoint_module(block, save="linear")
    y = block(torch.randn(4, 16, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        y.backward()


class _InplaceReLU(nn.Module):
    """Swinv2's position-bias MLP: nn.ReLU(inplace=True) on a Linear's output, which save="linear" keeps."""

    def __init__(self, h=16):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.ReLU(inplace=True), nn.Linear(4 * h, h))

    def forward(self, x):
        return torch.tanh(self.mlp(x))


@pytest.mark.parametrize("save", ["linear", "matmul"])
def test_kept_output_modified_in_place_in_the_block_is_recomputed(save):
    # torch's selective checkpoint raises "Tensor cached during selective activation checkpoint has
    # been mutated"; memfit recomputes that op (addmm twice per block: forward and recompute).
    ref = nn.Sequential(_InplaceReLU(), _InplaceReLU())
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(model, _InplaceReLU, save=save)
    x = torch.randn(8, 16)
    with OpCounter() as counter:
        loss = step(model, x)
    assert torch.equal(loss, step(ref, x))
    assert_same(grads(model), grads(ref))
    assert counter.counts[aten.addmm] == 2 * 2 + 2  # forward; the mutated one again (backward: mm)


def test_kept_output_modified_in_place_after_the_block_is_recomputed():
    kept = []

    def block(x):
        h = torch.mm(x, x)
        kept.append(h)
        return torch.tanh(h)

    x = torch.randn(4, 4, requires_grad=True)
    y = memfit.checkpoint(block, x, save="linear")
    with torch.no_grad():
        kept[0].add_(1)
    y.sum().backward()
    ref = x.detach().requires_grad_()
    block(ref).sum().backward()
    assert torch.equal(x.grad, ref.grad)
