"""What the planner's trace for a CUDA target maps beyond attention and dropout: CUDA autocast's
lower-precision and promote lists and the ops only the CPU lists, the optimizer autoconfigure
prices, and two threads planning at once (see [Note: The target's op stream])."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit._plan import _autoconfig
from memfit._plan._calibrate import device_profile
from memfit._plan._target import Target, target_of


class _Ops(torch.nn.Module):
    """Ops whose dtype under autocast differs between CUDA's lists and the CPU's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return {
            "mv": torch.mv(self.w, x[0]),  # CUDA: lower precision; the CPU: none
            "einsum": torch.einsum("ij,bj->bi", self.w, x),  # CUDA: lower precision
            "trace": torch.trace(x.to(torch.bfloat16)),  # the CPU: fp32; CUDA: none (bf16 stays)
            # CUDA: promote (fp32 and bf16 -> fp32); without it index_put refuses mixed dtypes
            "index_put": torch.index_put(x, (torch.tensor([0]),), x[:1].to(torch.bfloat16)),
            "log_softmax": torch.log_softmax(x.to(torch.bfloat16), -1),  # both: fp32 (CUDA's fp32 list)
        }


def _dtypes(target: Target) -> dict[str, torch.dtype]:
    with torch.autocast("cpu", dtype=torch.bfloat16), FakeTensorMode(), target.tracing():
        out = _Ops()(torch.ones(2, 4))
    return {k: v.dtype for k, v in out.items()}


def test_cuda_autocast_lists_for_h100():
    got = _dtypes(target_of(device_profile("h100")))
    assert got == {
        "mv": torch.bfloat16,
        "einsum": torch.bfloat16,
        "trace": torch.bfloat16,
        "index_put": torch.float32,
        "log_softmax": torch.float32,
    }
    # torch's own kernels back after the trace: the CPU's lists
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mv(torch.ones(4, 4), torch.ones(4)).dtype == torch.float32
        assert torch.trace(torch.ones(4, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_autoconfigure_prices_the_optimizer_cuda_runs(monkeypatch):
    seen = []
    plain = _autoconfig.optimizer_costs

    def spy(model, optimizer, foreach=None):
        seen.append(foreach)
        return plain(model, optimizer, foreach)

    monkeypatch.setattr(_autoconfig, "optimizer_costs", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for name in ("h100", "cpu"):
        _autoconfig.autoconfigure(
            model, torch.ones(4, 8), budget="1GB", world_size=1, device_profile=name, loss_fn=lambda out: out.sum()
        )
    assert seen == [True, None]  # CUDA's default (foreach) for h100, the host's for the CPU profile
    ops = {c.op for c in plain(model, "adamw", True)}
    assert "aten._foreach_addcdiv_" in ops and "aten._foreach_sqrt" in ops
    assert not any(op.startswith("aten._foreach") for c in plain(model, "adamw") for op in [c.op])


def test_two_threads_tracing_at_once():
    """The second tracing thread waits for the first; another thread's attention, dropout and
    autocast meanwhile are torch's own; after both, torch's functions are back."""
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout
    target = target_of(device_profile("h100"))
    inside, entered, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def first():
        with torch.autocast("cpu", dtype=torch.bfloat16), target.tracing():
            inside.set()
            done.wait(10)
            seen["second entered while the first traced"] = entered.is_set()

    def second():
        inside.wait(10)
        with target.tracing():
            entered.set()

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start(), b.start()
    inside.wait(10)
    q = torch.ones(1, 1, 4, 8)  # real CPU tensors: CUDA's kernels would not run here
    seen["attention"] = F.scaled_dot_product_attention(q, q, q).shape
    seen["dropout"] = F.dropout(torch.ones(8), 0.5, training=False).sum().item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen["linear"] = torch.nn.Linear(8, 8)(torch.ones(2, 8)).dtype  # no module hook of the first's
    done.set()
    a.join(10), b.join(10)
    assert seen == {
        "attention": torch.Size([1, 1, 4, 8]),
        "dropout": 8.0,
        "linear": torch.bfloat16,
        "second entered while the first traced": False,
    }
    assert entered.is_set()
    assert F.scaled_dot_product_attention is sdpa and F.dropout is dropout
