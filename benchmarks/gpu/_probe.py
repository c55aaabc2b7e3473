"""The race probe: a sharded model whose blocks are checkpointed with ``offload="cpu"``,
trained with gradient accumulation and ``zero_grad(set_to_none=False)``, its gradients
compared with a plain model's, with and without delays on memfit's side streams.

A delay is ``torch.cuda._sleep`` queued at the start of every piece of work memfit puts on
its gather and reduce streams (memfit/_shard/_streams.py, ``Streams.on``) and on host
offload's side stream (memfit/_checkpoint/_pinned.py, ``Streams.on_side``), patched in here
for the probe only. Work that a missing event wait lets run early then reads stale or
unfinished data, and the gradients change: a race shows as delayed != undelayed.

Also the workload of part a's ``TORCH_CUDA_SANITIZER=1`` subprocess:

    PYTHONPATH=. python -m benchmarks.gpu._probe [--cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

import memfit


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)], nn.LayerNorm(width))


@contextlib.contextmanager
def delayed_streams(cycles: int) -> Iterator[Counter]:
    """Queue ``torch.cuda._sleep(cycles)`` at the start of every entry into memfit's gather,
    reduce and offload side streams (CUDA only; on the CPU the entries are only counted)."""
    from memfit._checkpoint import _pinned
    from memfit._shard import _streams

    entered: Counter = Counter()
    on, on_side = _streams.Streams.on, _pinned.Streams.on_side

    @contextlib.contextmanager
    def slow_on(self, stream: str):
        with on(self, stream):
            if stream != "compute":
                entered[stream] += 1
                if self.cuda and cycles:
                    torch.cuda._sleep(cycles)
            yield

    @contextlib.contextmanager
    def slow_on_side(self):
        with on_side(self):
            entered["offload"] += 1
            if self.accel and self.device.type == "cuda" and cycles:
                torch.cuda._sleep(cycles)
            yield

    _streams.Streams.on, _pinned.Streams.on_side = slow_on, slow_on_side
    try:
        yield entered
    finally:
        _streams.Streams.on, _pinned.Streams.on_side = on, on_side


def _sharded(base: nn.Module, device: torch.device) -> nn.Module:
    """Blocks checkpointed with activation offload, sharded with their shards in host memory:
    at one rank a unit without offload computes on its chunks directly (no gather, no
    reduce-scatter), so the probe would never delay the gather and reduce streams; offloaded
    shards go through both (the host-to-device copy on gather, the copy back on reduce)."""
    model = copy.deepcopy(base)
    for block in model[:-1]:
        memfit.checkpoint_module(block, offload="cpu")
        memfit.shard(block, device=device, offload="cpu")
    return memfit.shard(model, device=device, offload="cpu")


def _train(model: nn.Module, inputs: list[list[torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Steps of accumulated micro-batches; the gradients of each step before the optimizer's."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for micro in inputs:
        opt.zero_grad(set_to_none=False)
        for x in micro:
            model(x).square().mean().backward()
        grads.append({n: p.grad.detach().clone().cpu() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def _compare(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """(bitwise equal, max relative difference) over every gradient of every step."""
    equal, worst = True, 0.0
    for ga, gb in zip(a, b, strict=True):
        if ga.keys() != gb.keys():
            raise AssertionError(f"gradients of different parameters: {sorted(ga.keys() ^ gb.keys())}")
        for n in ga:
            x, y = ga[n].double(), gb[n].double()
            equal = equal and torch.equal(ga[n], gb[n])
            worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return equal, worst


def race_probe(
    device: torch.device,
    *,
    width: int,
    blocks: int,
    batch: int,
    steps: int = 2,
    micro: int = 2,
    cycles: int = 2_000_000,
    vs_plain: bool = True,
) -> dict:
    """Gradients of the sharded, checkpointed, offloaded model with and without side-stream
    delays, against a plain model's (needs a process group; ``vs_plain=False`` at 2+ ranks,
    where each rank's gradients are its shards')."""
    from memfit.testing import host_offload_on_cpu

    base = build(width, blocks)
    g = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(batch, 16, width, generator=g).to(device) for _ in range(micro)] for _ in range(steps)]

    def on_cpu():  # "cpu" offload of CPU tensors takes the accelerator path (smoke runs)
        return host_offload_on_cpu() if device.type == "cpu" else contextlib.nullcontext()

    plain = _train(copy.deepcopy(base).to(device), inputs) if vs_plain else None
    with on_cpu():
        undelayed = _train(_sharded(base, device), inputs)
    with on_cpu(), delayed_streams(cycles) as entered:
        delayed = _train(_sharded(base, device), inputs)
    same_delayed, rel_delayed = _compare(delayed, undelayed)
    same_plain, rel_plain = _compare(undelayed, plain) if plain is not None else (None, None)
    return {
        "side_stream_entries": dict(entered),
        "sleep_cycles": cycles if device.type == "cuda" else 0,
        "delayed_bitwise_undelayed": same_delayed,
        "delayed_max_rel_diff": rel_delayed,
        "bitwise_vs_plain": same_plain,
        "max_rel_diff_vs_plain": rel_plain,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    from benchmarks.gpu._env import Env

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    env = Env(device=device, smoke=args.cpu, out=None, repo=None)
    with env.process_group():
        print(race_probe(device, width=64, blocks=2, batch=2, steps=1, cycles=0))


if __name__ == "__main__":
    main()
