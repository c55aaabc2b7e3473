"""Part j: the host tier against FSDP2's CPUOffloadPolicy (issue 50), on the same model.

BERT-large MLM (seq 512, batch 8, fp32, AdamW lr 1e-4) with its parameters, gradients and
optimizer state in host memory, at W=1 on NCCL (gloo on the CPU in smoke mode):
- torch FSDP2: ``fully_shard`` per layer, then the root, with
  ``offload_policy=CPUOffloadPolicy(pin_memory=True)``; AdamW as a user builds it (torch's
  default implementation for host tensors, the for-loop), stepped after backward;
- memfit: ``FullyShardedDataParallel(auto_wrap_policy=<layer>, offload="cpu")`` and
  ``memfit.host_optimizer(model, AdamW(...))`` (fused CPU AdamW, each unit stepped in backward
  on a worker thread).
Figures: median step time of 3 steps after 1 warm-up, allocator peaks, memfit's unit steps in
backward. Goal: memfit's step <= FSDP2's. Smoke: the 2-layer BERT on the CPU (FSDP2 unpinned,
as there is no accelerator to pin for). Never run on a GPU yet (docs/devices.md).
"""

from __future__ import annotations

import copy
import warnings

import torch

import memfit
from benchmarks.gpu._env import Env, errors_of, fmt, goal, mib, ratio
from benchmarks.gpu.bert import SMOKE
from memfit.models import PRESETS, bert_layer_class, bert_mlm, mlm_batch

STRATEGIES = ("torch FSDP2 CPUOffloadPolicy", "memfit host_optimizer")


def wrap(env: Env, strategy: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layer = bert_layer_class()
    if strategy == "memfit host_optimizer":
        model = memfit.FullyShardedDataParallel(model, auto_wrap_policy=layer, offload="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its one line saying which implementation steps
            return model, memfit.host_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=env.cuda)
    for m in [m for m in model.modules() if isinstance(m, layer)]:
        fully_shard(m, offload_policy=policy)
    model = fully_shard(model, offload_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def measure(env: Env, strategy: str, base: torch.nn.Module, batch: dict) -> dict:
    model, opt = wrap(env, strategy, copy.deepcopy(base).to(env.device))

    def step() -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    warmup, repeats = (0, 1) if env.smoke else (1, 3)
    seconds = env.median_time(step, warmup, repeats)
    peaks = env.allocator_peaks(step) if env.cuda else {"max_allocated": None, "max_reserved": None}
    host = getattr(opt, "_memfit_host_step", None)
    in_backward = host.steps_in_backward if host is not None else None
    return {"step_s": seconds, **peaks, "unit_steps_in_backward": in_backward}


def run(env: Env) -> dict:
    shape = SMOKE if env.smoke else PRESETS["bert-large"].shape
    results: dict[str, dict] = {"bert": {}}
    rows = results["bert"]
    with env.process_group():
        base = bert_mlm(shape)
        batch = {k: v.to(env.device) for k, v in mlm_batch(shape).items()}
        for strategy in STRATEGIES:
            env.log(f"  j: {strategy}")
            try:
                rows[strategy] = measure(env, strategy, base, batch)
            except Exception as e:  # recorded; the other still runs
                rows[strategy] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            env.free()
    md = [
        f"BERT MLM {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}, batch {shape.batch}, fp32, "
        "state in host memory; median of 3 steps after 1 warm-up.",
        "",
        "| strategy | step s | vs FSDP2 | max allocated MiB | max reserved MiB | unit steps in backward |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    fsdp = rows.get(STRATEGIES[0], {})
    for strategy, r in rows.items():
        if "error" in r:
            md.append(f"| {strategy} | {r['error']} |||||")
            continue
        md.append(
            f"| {strategy} | {r['step_s']:.4f} | {fmt(ratio(r['step_s'], fsdp.get('step_s')))} "
            f"| {mib(r['max_allocated'])} | {mib(r['max_reserved'])} | {r['unit_steps_in_backward'] or '-'} |"
        )
    mem = rows.get(STRATEGIES[1], {})
    if "step_s" in mem and "step_s" in fsdp:
        t = mem["step_s"] / fsdp["step_s"]
        goals = [goal("host tier: memfit vs FSDP2 CPUOffloadPolicy", t, "<= 1.00", t <= 1.0)]
    else:
        goals = [goal("host tier: memfit and FSDP2 CPUOffloadPolicy ran", None, "no error", False)]
    return {"figures": {"results": results, "errors": errors_of(results)}, "goals": goals, "markdown": md}
