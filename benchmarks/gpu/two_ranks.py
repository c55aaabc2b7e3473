"""Part h: two ranks on the one GPU over gloo, against one process.

NCCL refuses two ranks on one device; gloo carries CUDA tensors for the collectives it
supports, and for the others (the all-gather and reduce-scatter into one tensor) this part
stages through pinned host memory: the tensors go to the host, gloo runs there, the result
comes back (in the validation only: ``staged_collectives``; memfit itself never does this).
Both ranks compute on cuda:0 (smoke: the CPU, plain gloo).

The model: a BERT-MLM (4 layers, hidden 256, seq 128; smoke: the tiny one), dropout off, each
layer and the root sharded with ``MixedPrecision(bf16, reduce fp32)`` and ``offload="cpu"``,
AdamW; per step each rank runs 2 micro-batches that accumulate into the offloaded gradients
(the path of issue 48's second bug). After step 1 an asynchronous save
(``save_checkpoint(..., async_=True)``: issue 48's first bug); after step 2 a fresh model
resumes from it and runs step 2 again. The reference: one process running all 4 micro-batches
per step, with the same policy. Goals: the two ranks' parameters after 2 steps equal the one
process's within fp32 rounding (relative 1e-5: the same bf16 products, summed in another
order in fp32), the resumed step bitwise equal to the continued one, the race probe's delays
on every side stream (gather, reduce, offload) at two ranks, delayed == undelayed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.gpu._env import Env, fmt, goal
from benchmarks.gpu.bert import SMOKE
from memfit.models import Shape, bert_mlm, mlm_batch

SHAPE = Shape(layers=4, hidden=256, heads=4, seq=128, batch=4, vocab=30522)
MICRO = 2  # micro-batches per rank and step
STEPS = 2
HANG_S = 240  # a rank still running after this long prints its stack and exits


@contextlib.contextmanager
def staged_collectives(device: torch.device):
    """On CUDA over gloo: memfit's all-gather and reduce-scatter of CUDA tensors through pinned
    host memory (gloo has no CUDA path for them); nothing on the CPU."""
    from memfit._shard import _collectives as c

    if device.type != "cuda":
        yield
        return
    gather, scatter = c._all_gather, c._reduce_scatter

    def host(t):
        return t.detach().to("cpu", non_blocking=False).pin_memory()

    def staged_gather(out, inp, group=None, async_op=False):
        h_out = torch.empty(out.shape, dtype=out.dtype).pin_memory()
        gather(h_out, host(inp), group=group)
        out.copy_(h_out, non_blocking=True)
        return _Done()

    def staged_scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        h_in, h_out = host(inp), torch.empty(out.shape, dtype=out.dtype).pin_memory()
        dist.all_reduce(h_in, op=op, group=group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        h_out.copy_(h_in.view(world, -1)[rank].view(out.shape))
        out.copy_(h_out, non_blocking=True)
        return _Done()

    c._all_gather, c._reduce_scatter = staged_gather, staged_scatter
    try:
        yield
    finally:
        c._all_gather, c._reduce_scatter = gather, scatter


class _Done:
    """A finished collective's handle."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _model(shape: Shape, device: torch.device):
    import memfit

    model = bert_mlm(shape).eval()  # dropout off: the ranks and the reference draw no random numbers
    policy = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.bert.encoder.layer:
        memfit.shard(layer, mixed_precision=policy, offload="cpu", device=device)
    memfit.shard(model, mixed_precision=policy, offload="cpu", device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, shape: Shape, step: int, micro: list[int], device: torch.device) -> float:
    total = 0.0
    for k in micro:
        batch = {n: v.to(device) for n, v in mlm_batch(shape, seed=100 * step + k).items()}
        loss = model(**batch).loss / len(micro)  # the mean over this rank's; the ranks' are averaged
        loss.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _params(model) -> dict:
    import memfit

    with memfit.summon_full_params(model, writeback=False):
        return {n: p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()}  # pickled by value


def train(rank: int, world: int, smoke: bool, ckdir: str) -> dict:
    """Both steps, the async save after step 1, and the resumed step 2 (every rank calls it)."""
    import memfit

    shape = SMOKE if smoke else SHAPE
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    micro = [k for k in range(MICRO * 2) if k % world == rank]  # this rank's micro-batches
    torch.manual_seed(0)
    with staged_collectives(device):
        model, opt = _model(shape, device)
        losses = [_step(model, opt, shape, 0, micro, device)]
        future = memfit.save_checkpoint(ckdir, model, opt, async_=True)
        losses.append(_step(model, opt, shape, 1, micro, device))  # runs while the save writes
        future.result()
        after = _params(model)
        fresh, fresh_opt = _model(shape, device)
        memfit.load_checkpoint(ckdir, fresh, fresh_opt)
        resumed_loss = _step(fresh, fresh_opt, shape, 1, micro, device)
        resumed = _params(fresh)
        probe = None
        if world == 2:
            from benchmarks.gpu._probe import race_probe

            width, blocks, batch = (32, 2, 2) if smoke else (256, 2, 4)
            probe = race_probe(device, width=width, blocks=blocks, batch=batch, steps=1, vs_plain=False)
    losses_all = [torch.tensor(losses, dtype=torch.float64)]
    if world > 1:
        dist.all_reduce(losses_all[0])
        losses_all[0] /= world  # each rank's loss is the mean of its micro-batches
    return {"losses": losses_all[0].tolist(), "params": after, "resumed": resumed, "probe": probe, "rl": resumed_loss}


def _rank(rank: int, world: int, port: int, smoke: bool, ckdir: str, result: str) -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)  # a hang shows where, then ends
    if not smoke:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        out = train(rank, world, smoke, ckdir)
        if rank == 0:  # a file, not a queue: a pipe filled before the parent reads blocks the rank
            torch.save(out, result)
    finally:
        dist.destroy_process_group()


def spawned(world: int, smoke: bool, ckdir: str) -> dict:
    from memfit.testing import free_port

    result = f"{ckdir}.result.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _rank, args=(world, free_port(), smoke, ckdir, result), nprocs=world, start_method="spawn", join=True
    )
    return torch.load(result, weights_only=False)


def _rel(a: dict, b: dict) -> tuple[bool, float, str]:
    """(bitwise equal, the largest relative difference of a parameter, that parameter's name)."""
    same, worst, name = True, 0.0, ""
    for n, value in b.items():
        x, y = torch.from_numpy(a[n]).double(), torch.from_numpy(value).double()
        same = same and torch.equal(x, y)
        rel = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
        if rel > worst:
            worst, name = rel, n
    return same, worst, name


def run(env: Env) -> dict:
    with tempfile.TemporaryDirectory(prefix="memfit-gpu-two-") as tmp:
        two = spawned(2, env.smoke, os.path.join(tmp, "two"))
        one = spawned(1, env.smoke, os.path.join(tmp, "one"))
    _, vs_one, worst_param = _rel(two["params"], one["params"])
    resumed_same, resumed_rel, _ = _rel(two["resumed"], two["params"])
    probe = two["probe"] or {}
    entries = probe.get("side_stream_entries", {})
    sides = ("gather", "reduce", "offload") if env.cuda else ("offload",)
    figures = {
        "shape": str(SMOKE if env.smoke else SHAPE),
        "losses_two_ranks": two["losses"],
        "losses_one_process": one["losses"],
        "max_rel_param_diff_vs_one": vs_one,
        "worst_param": worst_param,
        "resumed_bitwise": resumed_same,
        "resumed_max_rel_diff": resumed_rel,
        "probe": probe,
    }
    goals = [
        goal("2 ranks == 1 process (parameters after 2 steps)", vs_one, "<= 1e-5 relative", vs_one <= 1e-5),
        goal("resumed step == continued step", resumed_rel, "bitwise", resumed_same),
        goal(
            f"race probe at 2 ranks: {', '.join(sides)} delayed",
            str(entries),
            "each > 0",
            all(entries.get(k, 0) > 0 for k in sides),
        ),
        goal("race probe at 2 ranks: delayed == undelayed", None, "bitwise", probe.get("delayed_bitwise_undelayed")),
    ]
    md = [
        f"- 2 ranks on {'the CPU' if env.smoke else 'cuda:0'} over gloo, BERT-MLM {figures['shape']}, bf16 params, "
        f"fp32 reduce, offload='cpu', {MICRO} accumulated micro-batches per rank, async save after step 1, "
        f"resume: losses {[round(x, 5) for x in two['losses']]} vs one process "
        f"{[round(x, 5) for x in one['losses']]}; parameters max relative difference {fmt(vs_one, 8)} "
        f"({worst_param}); "
        f"resumed step bitwise {fmt(resumed_same)}; race probe side-stream entries {entries}",
    ]
    return {"figures": figures, "goals": goals, "markdown": md}
