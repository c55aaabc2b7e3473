"""MemoryMeter: hand-computed bytes for small programs (torch's MemTracker on a real model: integration/)."""

import pytest
import torch
from torch import nn

import memfit


def test_views_add_nothing_and_peak_survives_frees():
    with memfit.MemoryMeter() as m:
        x = torch.empty(1000)  # 4000 bytes
        v = x[10:].view(-1, 10)  # a view: no new storage
        y = x * 2  # 4000 bytes
        del y
        z = torch.ones(100)  # 400 bytes, after y was freed
    assert m.peak_bytes == 4000 + 4000
    assert m.breakdown()["activations_and_other"] == 8000
    del v, z


def test_tensors_from_before_count_once_touched():
    a = torch.randn(250)  # 1000 bytes, created outside the region
    with memfit.MemoryMeter() as m:
        b = a + 1  # 1000 bytes
        c = b.add_(1)  # in place: same storage
    assert m.peak_bytes == 2000
    assert c.untyped_storage()._cdata == b.untyped_storage()._cdata


def test_storage_resize_is_tracked():
    t = torch.empty(1000)  # 4000 bytes, made before the region
    with memfit.MemoryMeter() as m:
        t.add_(1)  # touched: counted
        t.untyped_storage().resize_(0)  # freed in place
        u = torch.empty(500)  # 2000 bytes
        t.untyped_storage().resize_(4000)  # refilled
    assert m.peak_bytes == 4000 + 2000
    assert m.current_bytes == 4000 + 2000
    del u


def test_dtype_and_device_filter():
    with memfit.MemoryMeter("cpu") as m:
        torch.zeros(10, dtype=torch.float64)  # 80 bytes
        torch.zeros(10, dtype=torch.bfloat16)  # 20 bytes, the float64 one is already freed
        torch.zeros(10, device="meta")  # no memory
    assert m.peak_bytes == 80


def adam_step(model, opt, x):
    model(x).square().sum().backward()
    opt.step()


def test_breakdown_with_model_and_optimizer():
    model = nn.Linear(10, 10)  # 100 + 10 parameters, 440 bytes
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 10)
    adam_step(model, opt, x)  # creates the optimizer state
    with memfit.MemoryMeter(model=model, optimizer=opt) as m:
        adam_step(model, opt, x)
    b = m.breakdown()
    params = 440
    grads = 440  # the previous step's grads are still set (no zero_grad)
    state = 2 * 440 + 2 * 4  # exp_avg and exp_avg_sq per parameter, plus a float32 step each
    assert b["parameters"] == params
    assert b["gradients"] == grads
    assert b["optimizer_state"] == state
    assert sum(b.values()) == m.peak_bytes
    assert m.peak_bytes > params + grads + state  # plus the batch and temporaries


def test_deterministic():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    peaks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with memfit.MemoryMeter(model=model) as m:
            model(x).sum().backward()
        peaks.append((m.peak_bytes, m.breakdown()))
    assert peaks[0] == peaks[1] == peaks[2]


def test_not_reentrant():
    m = memfit.MemoryMeter()
    with m, pytest.raises(RuntimeError, match="not reentrant"):
        m.__enter__()
