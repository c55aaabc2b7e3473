"""offload="cpu" on the CPU harness (memfit.testing.host_offload_on_cpu: CPU tensors take the
accelerator path, copies run synchronously, stream waits/records are traced): what is kept,
what is copied (bytes), strides, tensors saved twice, the stash bound, prefetch order, and
gradients bitwise equal to plain checkpointing; the pinned buffer pool, and disk offload's
staging through it. Only a GPU runs the real streams, pinning and asynchronous copies."""

import contextlib
import copy
import gc
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn

import memfit
import memfit.testing
from tests._parity import assert_same, grads

F32 = 4


@pytest.fixture
def harness():
    stats = memfit.testing.offload_stats()
    stats.reset()
    with memfit.testing.host_offload_on_cpu() as trace:
        yield stats, trace
    assert trace.violations() == []


def _blocks(n=6, h=64):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(n)])


def _run(model, leaf, shape):
    model(shape(leaf)).square().sum().backward()
    return grads(model), leaf.grad


def _parity(build, leaf, save, offload, shape=lambda x: x):
    """Gradients (parameters and input) of offloaded vs plain checkpointed blocks, bitwise."""
    ref = build()
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(ref, lambda m: m in list(ref), save=save)
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), save=save, offload=offload)
    g_ref, gx_ref = _run(ref, leaf.detach().clone().requires_grad_(), shape)
    g, gx = _run(model, leaf, shape)
    assert_same(g, g_ref)
    assert_same([gx], [gx_ref])


def _conv_blocks():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(3)])
    return blocks.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("save", [None, "all"])
def test_linear_blocks_bitwise(harness, save):
    stats, _ = harness
    x = torch.randn(32, 64, requires_grad=True)
    _parity(_blocks, x, save, memfit.Offload("cpu", stash=1))
    assert stats.d2h_copies > 0 and stats.h2d_copies > 0  # the copy path ran


@pytest.mark.parametrize("save", [None, "all"])
def test_channels_last_conv_bitwise(harness, save):
    stats, _ = harness
    x = torch.randn(2, 8, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    _parity(_conv_blocks, x, save, memfit.Offload("cpu", stash=1))
    assert stats.d2h_copies > 0


def test_expanded_input_bitwise(harness):
    stats, _ = harness
    row = torch.randn(1, 64, requires_grad=True)
    # stride 0: 64 elements of storage, saved by the first Linear
    _parity(_blocks, row, "all", memfit.Offload("cpu", stash=1), shape=lambda r: (r * 1).expand(32, 64))
    assert stats.d2h_copies > 0


class _Probe(torch.autograd.Function):
    """Saves its inputs; backward records how the saved tensors came back."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, *xs):
        ctx.save_for_backward(*xs)
        return xs[0].clone()

    @staticmethod
    def backward(ctx, g):
        _Probe.seen[:] = [
            (x.stride(), x.storage_offset(), x.untyped_storage().data_ptr(), x.clone()) for x in ctx.saved_tensors
        ]
        return (g,) + (None,) * (len(ctx.saved_tensors) - 1)


def _probe_round_trip(base, make, offload):
    def fn(b):
        return _Probe.apply(*make(b * 1)).sum()

    memfit.checkpoint(fn, base, save="all", offload=offload).backward()
    return _Probe.seen


@pytest.mark.parametrize(
    ("make", "stored", "exact"),
    [
        (lambda b: b.to(memory_format=torch.channels_last), 2 * 8 * 4 * 4, True),
        (lambda b: b[:1, :1].expand(2, 8, 4, 4), 4 * 4, True),  # the expanded size is never copied
        (lambda b: b.permute(0, 2, 3, 1), 2 * 8 * 4 * 4, True),
        (lambda b: b[1:], 8 * 4 * 4, True),  # the region from the offset on
        (lambda b: b[:, ::2], 2 * 4 * 4 * 4, False),  # gaps: only the elements move, back dense
    ],
)
def test_strides_survive_the_round_trip(harness, make, stored, exact):
    stats, _ = harness
    base = torch.randn(2, 8, 4, 4, requires_grad=True)
    ((stride, _, _, value),) = _probe_round_trip(base, lambda b: (make(b),), memfit.Offload("cpu", min_bytes=0))
    expected = make(base.detach() * 1)
    assert stats.d2h_bytes == stored * F32
    assert torch.equal(value, expected)
    assert stride == expected.stride() if exact else value.is_contiguous()


def test_views_of_one_region_come_back_as_views_of_one_copy(harness):
    stats, _ = harness
    base = torch.randn(2, 8, 4, 4, requires_grad=True)
    (_, o0, p0, v0), (s1, o1, p1, v1) = _probe_round_trip(
        base, lambda b: (b, b[1:, 2:].transpose(1, 2)), memfit.Offload("cpu", min_bytes=0)
    )
    assert (stats.d2h_copies, stats.shared) == (1, 1)
    expected = base.detach()[1:, 2:].transpose(1, 2)
    assert torch.equal(v0, base.detach()) and torch.equal(v1, expected)
    assert p0 == p1 and (s1, o1 - o0) == (expected.stride(), expected.storage_offset())


@pytest.mark.parametrize("as_module", [True, False])
def test_linear_save_all_moves_no_weight_bytes(harness, as_module):
    stats, _ = harness
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True) * 1  # not a leaf: an activation
    # Linear saves its input and weight.t(), a view of the weight: only the input moves
    # (kept as a view of a parameter, and, for the module, as sharing the module's storage).
    block = lin if as_module else (lambda t: nn.functional.linear(t, lin.weight, lin.bias))
    memfit.checkpoint(block, x, save="all", offload="cpu").sum().backward()
    assert (stats.d2h_copies, stats.d2h_bytes) == (1, 16 * 64 * F32)
    assert stats.kept >= 1


def test_a_tensor_saved_twice_is_copied_once(harness):
    stats, _ = harness
    x = torch.randn(16, 64, requires_grad=True)

    def fn(t):
        t = t * 2
        # t saved by mul twice, t.t() and t by mm; exp's output pushes t out of the stash
        return (t * t).sum() + (t.t() @ t).sum() + t.exp().sum()

    ref = x.detach().clone().requires_grad_()
    memfit.checkpoint(fn, x, save="all", offload=memfit.Offload("cpu", stash=1)).backward()
    fn(ref).backward()
    assert torch.equal(x.grad, ref.grad)
    assert (stats.d2h_copies, stats.d2h_bytes) == (2, 2 * 16 * 64 * F32)  # t and exp(t)
    assert stats.shared == 3
    assert (stats.h2d_copies, stats.h2d_bytes) == (1, 16 * 64 * F32)  # t back once too


def test_small_tensors_stay(harness):
    stats, _ = harness
    x = torch.randn(4, 16, requires_grad=True)  # 256 bytes
    memfit.checkpoint(torch.tanh, x, save="all", offload="cpu").sum().backward()
    assert stats.d2h_copies == 0  # under the default 1024 bytes
    memfit.checkpoint(torch.tanh, x, save="all", offload=memfit.Offload("cpu", min_bytes=0)).sum().backward()
    assert stats.d2h_copies == 1
    assert memfit.Offload("cpu").min_bytes == 1024 and memfit.Offload("disk").min_bytes == 0


def test_min_bytes_counts_the_bytes_a_copy_moves(harness):
    # 64 KiB as seen, 256 bytes of storage: a copy would move 256 bytes.
    ex = torch.randn(1, 64).expand(256, 64)
    assert not memfit.testing.offloadable(ex, 1024)
    assert memfit.testing.offloadable(ex, 256)
    assert memfit.testing.offloadable(torch.randn(256, 64), 1024)
    assert not memfit.testing.offloadable(torch.randn(0, 64), 0)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.randn(16, 64))

    def forward(self, x):
        return (x * self.scale).tanh()  # mul saves the buffer, tanh its output


def test_module_buffers_stay(harness):
    stats, _ = harness
    block = memfit.checkpoint_module(_Scaled(), save="all", offload="cpu")
    x = torch.randn(16, 64, requires_grad=True) * 1
    block(x).sum().backward()
    assert (stats.d2h_copies, stats.d2h_bytes) == (1, 16 * 64 * F32)  # tanh's output; not the buffer


def _outstanding(log, prefix):
    return memfit.testing.Trace(log).alive(lambda name: name.startswith(prefix))


@pytest.mark.parametrize("save", [None, "all"])
def test_prefetch_stash_and_stream_order(harness, save):
    stats, trace = harness
    n = 6
    model = _blocks(n)
    memfit.apply_activation_checkpointing(
        model, lambda m: m in list(model), save=save, offload=memfit.Offload("cpu", stash=2)
    )
    x = torch.randn(32, 64, requires_grad=True)
    out = model(x).sum()
    assert _outstanding(trace.log, "src")[0] <= 2 + 1  # stash, plus the copy being issued
    out.backward()
    # Each block's tensors were copied back while the block after it ran its backward: the
    # last blocks' were still on the device (stash), none was fetched on demand.
    assert stats.on_demand == 0
    assert stats.prefetched == stats.h2d_copies == stats.d2h_copies - 2
    assert stats.from_stash >= 2
    # At most two blocks' tensors on the device at once; everything released at the end.
    per_block = stats.d2h_copies // (n - 1) if save else 1
    most, left = _outstanding(trace.log, "dev")
    assert most <= 2 * max(per_block, 1) and not left
    assert not _outstanding(trace.log, "src")[1]
    del out
    gc.collect()
    assert not _outstanding(trace.log, "host")[1]  # every host copy freed once autograd let go
    uses = [(i, e) for i, e in enumerate(trace.log) if e[0] == "use" and e[1].startswith("dev")]
    for i, (_, name, stream) in uses:
        if stream == "compute":  # the copy back was issued before the use
            assert any(j < i and n2 == name and s == "side" for j, (_, n2, s) in uses)


def test_forward_releases_the_inputs_of_blocks_before_the_previous_one(harness):
    stats, trace = harness
    model = _blocks(6)
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), offload="cpu")  # stash 5
    out = model(torch.randn(32, 64, requires_grad=True)).sum()
    # Five block inputs offloaded (x is a leaf: kept); only the last two blocks' still held.
    assert stats.d2h_copies == 5
    most, held = _outstanding(trace.log, "src")
    assert most == 2 and len(held) == 2
    out.backward()
    assert stats.from_stash == 2 and stats.prefetched == 3


def test_trace_checker_catches_early_free_and_unordered_use():
    trace = memfit.testing.Trace()
    trace.log = [("alloc", "b", "compute"), ("use", "b", "side"), ("free", "b", "compute"), ("use", "b", "compute")]
    # used on side without a wait; freed before compute waited; used after it was freed
    assert len(trace.violations()) == 3
    trace.log = [
        ("alloc", "b", "compute"),
        ("record", "compute", 0),
        ("wait", "side", 0),
        ("use", "b", "side"),
        ("record", "side", 1),
        ("wait", "compute", 1),
        ("free", "b", "compute"),
    ]
    assert trace.violations() == []


def test_retained_graph_backward_twice(harness):
    stats, _ = harness
    model = _blocks(3)
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), offload=memfit.Offload("cpu", stash=1))
    x = torch.randn(32, 64, requires_grad=True)
    out = model(x).sum()
    out.backward(retain_graph=True)
    first, copies = grads(model), stats.h2d_copies
    model.zero_grad()
    out.backward()
    assert_same(grads(model), first)
    assert stats.h2d_copies == 2 * copies  # the host copies stayed: the second pass copies back again


def test_bad_offload_options():
    with pytest.raises(ValueError, match="min_bytes must be an integer >= 0"):
        memfit.Offload("cpu", min_bytes=-1)
    with pytest.raises(ValueError, match="stash must be an integer >= 1"):
        memfit.Offload("cpu", stash=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: real streams, pinned memory, async copies")
@pytest.mark.parametrize("save", [None, "all"])
def test_on_cuda_same_gradients_and_bytes_as_the_cpu_harness(save):
    """Not run on the CPU-only machine this suite was written on (see docs/devices.md)."""
    stats = memfit.testing.offload_stats()
    counts = []
    for device, harness in (("cpu", memfit.testing.host_offload_on_cpu), ("cuda", contextlib.nullcontext)):
        model = _blocks(6).to(device)
        blocks = list(model)
        memfit.apply_activation_checkpointing(model, lambda m, b=blocks: m in b, save=save, offload="cpu")
        x = torch.randn(32, 64, device=device, requires_grad=True)
        stats.reset()
        with harness():
            model(x).square().sum().backward()
        counts.append((stats.d2h_bytes, stats.h2d_bytes, stats.on_demand))
        ref = _blocks(6).to(device)
        ref(x.detach().requires_grad_()).square().sum().backward()
        assert_same([g.cpu() for g in grads(model)], [g.cpu() for g in grads(ref)])
    assert counts[0] == counts[1]


def test_a_dropped_graph_is_freed_without_backward(harness):
    """Forward only (a skipped step, an OOM retry): dropping the output frees the graph at
    once, as without offload. The stash must not hold a saved output (tanh's) with its
    grad_fn, a cycle through autograd's C++ graph that only the next forward broke."""
    _, trace = harness
    model = _blocks(3)
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), save="all", offload="cpu")
    out = model(torch.randn(32, 64, requires_grad=True))
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None
    assert not _outstanding(trace.log, "src")[1] and not _outstanding(trace.log, "host")[1]


def _modify_after_save(offload, save, later_blocks=0):
    x = torch.randn(32, 64, requires_grad=True)
    h = x * 1
    y = memfit.checkpoint(torch.sigmoid, h, save=save, offload=offload)  # saves h, or sigmoid's output
    loss = (y * 2).sum()
    for _ in range(later_blocks):  # their copies push h's or y's out of the stash
        loss = loss + memfit.checkpoint(torch.sigmoid, x * 2, save=save, offload=offload).sum()
    (h if save is None else y).mul_(3)  # autograd refuses this at backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("save", [None, "all"])
@pytest.mark.parametrize(("stash", "later_blocks"), [(1, 0), (5, 0), (5, 3)])
def test_modified_in_place_after_offload_fails_as_autograd_does(harness, save, stash, later_blocks):
    stats, _ = harness
    _modify_after_save(memfit.Offload("cpu", stash=stash, min_bytes=0), save, later_blocks)
    assert stats.d2h_copies == 1 + later_blocks


@pytest.mark.parametrize("save", [None, "all"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_modified_in_place_after_save_fails_for_kept_tensors(save, offload):
    # Without the harness "cpu" keeps every CPU tensor in place; saved-tensor hooks turn off
    # autograd's own version check, so offload must check itself.
    _modify_after_save(offload, save)


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
def test_weight_modified_after_save_fails_with_every_target(offload):
    lin = nn.Linear(64, 64)  # saves weight.t(), a view of the weight: kept by every target
    x = torch.randn(8, 64, requires_grad=True) * 1
    loss = memfit.checkpoint(lin, x, save="all", offload=offload).sum()
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("stash", [1, 5])
def test_a_view_an_op_made_inside_shares_its_base_copy(harness, stash):
    stats, _ = harness
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(1, 16 * 64, requires_grad=True)

    def fn(b):
        t = b * 2
        # saves t.view(1, -1): a view nothing holds once saved; then t itself, after tanh's
        # output has pushed the view's copy out of a one-tensor stash
        s = (t.view(1, -1) * w).sum() + t.tanh().sum()
        return s + (t * t).sum()

    memfit.checkpoint(fn, x, save="all", offload=memfit.Offload("cpu", stash=stash)).backward()
    ref = x.detach().clone().requires_grad_()
    fn(ref).backward()
    assert torch.equal(x.grad, ref.grad)
    assert (stats.d2h_copies, stats.shared) == (2, 2)  # t (and its view), tanh(t)


@pytest.mark.parametrize("later_blocks", [0, 3])
def test_modified_in_place_then_dropped_while_in_the_stash_fails(harness, later_blocks):
    # On a GPU the copy to the host may still be running when compute modifies the tensor:
    # the values saved are unknown. The stash still holds it: the change is seen there.
    w = torch.randn(32, 64, requires_grad=True)

    def fn(b):
        t = b * 2
        s = (t * w).sum()  # saves t
        t.mul_(3)
        return s  # t is dropped here

    x = torch.randn(32, 64, requires_grad=True)
    loss = memfit.checkpoint(fn, x, save="all", offload=memfit.Offload("cpu", min_bytes=0))
    for _ in range(later_blocks):  # their copies push t's out of the stash
        loss = loss + memfit.checkpoint(torch.sigmoid, x * 2, save="all", offload="cpu").sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("harness_on", [False, True])
def test_a_dropped_graph_is_freed_with_kept_outputs(harness_on):
    # tanh's output, under min_bytes (or, off the harness, on the CPU): kept. Kept as it is, it
    # would hold its own grad_fn, a cycle through C++ that the garbage collector never frees.
    x = torch.randn(4, 16, requires_grad=True)
    with memfit.testing.host_offload_on_cpu() if harness_on else contextlib.nullcontext():
        out = memfit.checkpoint(lambda t: torch.tanh(t * 2), x, save="all", offload="cpu")
        alive = weakref.ref(out)
        del out
        gc.collect()
        assert alive() is None


@pytest.mark.parametrize("harness_on", [False, True])
def test_double_backward_through_kept_and_offloaded_tensors(harness_on):
    # Kept outputs (tanh's) and weight views are held detached: autograd must still rebuild
    # their history for a gradient of a gradient.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    x0 = torch.randn(8, 16)

    def run(offload):
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = memfit.checkpoint(model, x * 1, save="all", offload=offload)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        g.square().sum().backward()
        return [*grads(model), x.grad]

    ref = run(None)
    stats = memfit.testing.offload_stats()
    stats.reset()
    with memfit.testing.host_offload_on_cpu() if harness_on else contextlib.nullcontext():
        assert_same(run(memfit.Offload("cpu", min_bytes=256)), ref)
    assert stats.kept > 0 and (stats.d2h_copies > 0) == harness_on  # some kept, some copied


def _autocast_blocks(offload, h=256):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(6)])
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), save="all", offload=offload)
    return model


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_autocast_weight_casts_are_made_again_not_moved(harness, offload):
    # Under autocast a Linear saves weight.to(bf16).t(): a cast of the parameter. Offload makes
    # it again from the weight in backward instead of moving it (twice its bytes on the link
    # per step, for nothing: autocast's cache holds it on the device until forward ends).
    stats, _ = harness
    x = torch.randn(4, 256)
    results = []
    for target in (None, offload):
        model = _autocast_blocks(target)
        leaf = x.clone().requires_grad_()
        stats.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(leaf).float().square().sum()
        loss.backward()
        results.append((grads(model), leaf.grad))
    assert_same(results[1][0], results[0][0])  # bitwise: the same cast, made twice
    assert_same([results[1][1]], [results[0][1]])
    assert stats.recast == 6 + 1  # one weight cast per Linear, and the input's (a leaf that requires grad)
    activation = 4 * 256 * 2  # a bf16 activation; a bf16 weight is 64x larger
    assert offload == "disk" or (stats.d2h_bytes % activation == 0 and stats.d2h_bytes <= 2 * 6 * activation)


def test_weight_modified_after_an_autocast_save_fails(harness):
    model = _autocast_blocks("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 256, requires_grad=True)).float().sum()
    with torch.no_grad():
        model[0][0].weight.mul_(2)  # the recast would silently use the new values
    with pytest.raises(RuntimeError, match=r"parameter float32\[256, 256\] was modified in place between forward"):
        loss.backward()


def test_views_of_casts_as_another_dtype_move_as_they_are(harness):
    stats, _ = harness
    w = nn.Parameter(torch.randn(64, 64, dtype=torch.complex64))
    x = torch.randn(8, 64, 64, 2, requires_grad=True) * 1

    def fn(t):
        return (t * torch.view_as_real(w.to(torch.complex128))).sum(-1)

    ref = fn(x).square().sum()
    g_ref = torch.autograd.grad(ref, (x, w))
    stats.reset()
    out = memfit.checkpoint(fn, x, save="all", offload="cpu").square().sum()
    assert_same(list(torch.autograd.grad(out, (x, w))), list(g_ref))
    assert stats.recast == 0


def _steps(offload, batches, h=1024, n=4):
    """Steps of checkpointed Linear blocks with ``offload`` and without, gradients compared
    bitwise each step; yields after each step (the offloaded graph freed)."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(n)])
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(ref, lambda m: m in list(ref))
    memfit.apply_activation_checkpointing(model, lambda m: m in list(model), offload=offload)
    for b in batches:
        x = torch.randn(b, h)  # no grad: offloaded as every block's input is
        for m in (ref, model):
            m.zero_grad()
            m(x).square().sum().backward()
        assert_same(grads(model), grads(ref))
        yield


def test_pinned_pool_sizes_buffers_exactly_and_reuses_them(harness):
    """3 x 1024 floats per block input: 12288 bytes held, where torch's host allocator would
    hold 16384. Step 2 (same shapes) allocates nothing; step 3 (larger) leaves the pool at its
    own size. See [Note: Pinned host buffers]."""
    stats, trace = harness
    n, rows = 4, 3
    other = stats.pinned_bytes  # a gauge: what pools of earlier tests still hold (0 unless one leaked)
    steps = _steps(memfit.Offload("cpu", stash=1), [rows, rows, 5], n=n)
    next(steps)
    assert stats.d2h_copies == n and stats.d2h_bytes == n * rows * 1024 * F32
    assert (stats.pinned_new, stats.pinned_reused) == (n, 0)
    assert stats.pinned_bytes - other == stats.pinned_peak - other == stats.d2h_bytes  # not 4 x 16384
    stats.reset()
    next(steps)
    assert (stats.pinned_new, stats.pinned_reused) == (0, n)
    assert stats.pinned_bytes - other == stats.pinned_peak - other == n * rows * 1024 * F32  # reset() kept it
    stats.reset()
    next(steps)
    assert (stats.pinned_new, stats.pinned_reused) == (n, 0)
    assert stats.pinned_peak - other == n * (rows + 5) * 1024 * F32  # both sizes, during step 3
    assert stats.pinned_bytes - other == n * 5 * 1024 * F32  # the free 3-row buffers released
    assert not _outstanding(trace.log, "host")[1]
    # issue 48: shrinking happens inside backward, and never makes the host wait for the side stream
    assert [e for e in trace.log if e[:2] == ("wait", "host")] == []


def test_trace_checker_catches_a_host_use_of_a_pool_buffer_not_waited_for():
    trace = memfit.testing.Trace()
    copy_then_write = [("alloc", "stage#0", "side"), ("use", "stage#0", "side"), ("use", "stage#0", "host")]
    trace.log = list(copy_then_write)
    bad = trace.violations()  # the file written before the copy into the buffer is done
    assert bad and all(v.startswith("stage#0 used on host at 2") for v in bad)
    trace.log = [*copy_then_write[:2], ("record", "side", 0), ("wait", "host", 0), copy_then_write[2]]
    assert trace.violations() == []


def _host_waits_before(log, i, buffer):
    """Whether the host waited, before ``log[i]``, for a side event recorded after ``buffer``'s
    last use on the side stream."""
    side_use = max(j for j in range(i) if log[j][:3] == ("use", buffer, "side"))
    recorded = {e: j for j, (k, s, e) in enumerate(log[:i]) if k == "record" and s == "side" and j > side_use}
    return any(k == "wait" and s == "host" and e in recorded for k, s, e in log[side_use:i])


def test_disk_offload_stages_through_pinned_buffers_on_the_side_stream(harness, tmp_path):
    """A device tensor goes to disk through a pinned staging buffer copied on the side stream
    (no blocking copy on compute): the file is written only after the host waited for that
    copy; in backward compute waits for the copy back before autograd uses the tensor. Step 2
    reuses the staging buffer. See [Note: Offload of saved tensors]."""
    stats, trace = harness
    writes = []

    def write(path, t, real_write):
        writes.append((len(trace.log), t.untyped_storage().data_ptr()))
        real_write(path, t)

    steps = _steps(memfit.Offload("disk", directory=str(tmp_path)), [3, 3], n=3)
    with memfit.testing.offload_writer(write):
        next(steps)
        assert stats.pinned_new == 1  # one staging buffer, taken and given back per write
        next(steps)
    assert stats.pinned_new == 1 and stats.pinned_reused == 2 * 3 * 2 - 1  # 3 writes and 3 reads a step
    log = trace.log
    staged = [(i, n) for i, (k, n, s) in enumerate(log) if k == "use" and str(n).startswith("stage#") and s == "host"]
    assert len(staged) == 2 * 3 * 2
    assert len({ptr for _, ptr in writes}) == 1  # every write read the one staging buffer
    for at, _ in writes:  # after the host waited for the copy into it
        i, name = max((i, n) for i, n in staged if i < at)
        assert _host_waits_before(log, i, name)
    devs = [n for k, n, s in log if k == "use" and str(n).startswith("dev#") and s == "compute"]
    assert len(devs) == 2 * 3  # every tensor read back was copied on side, then waited for by compute
    assert trace.violations() == []
