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


def test_cross_entropy_under_autocast_as_cuda_runs_it():
    """CUDA autocast's fp32_set_opt_dtype: cross_entropy's composite passes the logits' dtype to
    log_softmax (bf16 log-probabilities, no copy of the logits before it); with no dtype given,
    softmax runs with dtype=float32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, tuple, torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self.ops.append((str(func), tuple(first.shape), first.dtype))
            return out

    class Head(torch.nn.Module):
        def forward(self, logits, labels):
            return F.cross_entropy(logits, labels), torch.softmax(logits, -1)

    logits, labels = torch.ones(4, 50, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16), target_of(device_profile("h100")).tracing(), Log() as log:
        loss, probs = Head()(logits, labels)
    assert loss.dtype == torch.float32 and probs.dtype == torch.float32
    first = [op for op in log.ops if op[0] == "aten._log_softmax.default"]
    assert first == [("aten._log_softmax.default", (4, 50), torch.bfloat16)]
    before = log.ops[: log.ops.index(first[0])]
    assert not any(op[0] == "aten._to_copy.default" for op in before)  # no fp32 (or bf16) copy of the logits


def test_offload_stash_in_the_forecast():
    """On a device with streams the forward's stash holds the last two offloaded blocks' inputs
    ([Note: The offload stash]): a part of the end of forward's forecast; none on the CPU; the
    solver's plans fit their budgets with it."""
    import dataclasses

    from memfit._plan._profile import profile_model
    from memfit._plan._profile_types import block_names
    from memfit._plan._solve import forecast, solve, timeline

    def no_stash(p):
        return dataclasses.replace(p, offload_stash=0)

    from memfit.models import Shape, bert_mlm, mlm_batch

    shape = Shape(layers=4, hidden=32, heads=2, seq=32, batch=2, vocab=64)
    with torch.device("meta"):
        model = bert_mlm(shape)
    for name, groups in (("h100", 2), ("cpu", 0)):
        prof = profile_model(model, mlm_batch(shape), device=device_profile(name), chunk_head=False)
        assert prof.offload_stash == groups
        n = len(prof.blocks)
        inputs = [b.input_bytes for b in prof.blocks]
        moments = {m["moment"]: m["parts"] for m in timeline(prof, ["offload"] * n)}
        assert moments["end of forward"]["offload_stash"] == (sum(inputs[-2:]) if groups else 0)
        last = block_names(prof)[-1]  # its forward: the one offloaded before it (a new group drops older ones)
        assert moments[f"forward of {last}"]["offload_stash"] == (inputs[-2] if groups else 0)
        mixed = ["full"] * (n - 1) + ["offload"]  # one block offloaded: its input only
        assert {m["moment"]: m["parts"] for m in timeline(prof, mixed)}["end of forward"]["offload_stash"] == (
            inputs[-1] if groups else 0
        )
        assert forecast(prof, ["offload"] * n)["peak"] >= forecast(no_stash(prof), ["offload"] * n)["peak"]
        lo = forecast(prof, ["offload"] * n)["peak"]
        for budget in (int(lo * 1.001), int(lo * 1.05), int(lo * 1.2)):
            plan = solve(prof, budget, allowed=("full", "offload"))
            assert plan is not None and forecast(prof, plan)["peak"] <= budget
