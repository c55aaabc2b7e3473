"""`memfit plan`: the plan and per-rank forecast of a model for a budget, on fake tensors (the
model is built on the meta device: an 8B model plans on a laptop), ending with the `memfit train`
command that runs it; `memfit calibrate`."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

import memfit
from memfit._plan._budget import describe_bytes, format_bytes
from memfit._plan._calibrate import cache_path, calibrate, save_profile
from memfit._plan._time import default_profile
from memfit.cli._choose import PLANNED_KINDS, mixed_precision
from memfit.cli._config import DTYPES, CalibrateConfig, PlanConfig, tier_options
from memfit.cli._data import batch_at, check_first_batch
from memfit.cli._output import plot_timeline, write_json
from memfit.cli._progress import phase

__all__ = ["DTYPES", "CalibrateConfig", "PlanConfig", "calibrate_command", "plan_command", "run_lines"]


def plan_command(cfg: PlanConfig) -> memfit.Plan:
    spec = cfg.spec()
    seq, rows = spec.seq, spec.batch
    # planning needs shapes only: nothing is allocated, no weights are read
    with phase("plan", f"building {cfg.model} on the meta device"), torch.device("meta"):
        model = spec.build(0).to(DTYPES[cfg.dtype])
    batch = batch_at(spec.arch, rows, seq, step=0)
    check_first_batch(cfg.COMMAND, model, batch)
    params = sum(p.numel() for p in model.parameters())
    device, why = _device_profile(cfg.device_profile)
    mixed = mixed_precision(cfg.mixed_precision)
    held = f"{cfg.dtype} parameters, gradients and optimizer state"
    if mixed is not None:
        held = f"{cfg.mixed_precision} compute (torch.nn norm layers fp32), fp32 master weights, gradients and "
        held += "optimizer state"
    layout = f"world size {cfg.world_size}"
    if cfg.shard_size and cfg.shard_size < cfg.world_size:
        layout += f" as {cfg.world_size // cfg.shard_size} replicas x {cfg.shard_size} shards (hybrid sharding)"
    print(
        f"{cfg.model}: {spec.about}\nbatch {rows} x seq {seq} per rank, {_count(params)} parameters, AdamW, "
        f"{held}, {layout}\ntime priced on: {device.name} ({why})\n"
    )
    if cfg.auto:
        return auto_command(cfg, model, batch, device)
    with phase("plan", f"profiling one batch on fake tensors and solving for {cfg.budget}"):
        plan = memfit.plan(
            model,
            batch,
            budget=cfg.budget,
            world_size=cfg.world_size,
            shard_size=cfg.shard_size,
            device_profile=device,
            mixed_precision=mixed,
            **tier_options(cfg),
        )
    print(plan.table())
    if cfg.json:
        write_json(cfg.json, plan.to_dict())
    _plot(cfg, plan)
    print("\n".join(run_lines(cfg, plan, seq, rows)))
    if plan.tiers is not None:  # memfit train plans the tiers on its own first batch, as here
        given = " ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in tier_options(cfg) if k != "max_norm")
        given += f" --clip {cfg.clip}" * (cfg.clip != 1.0)
        print(f"the tiers: memfit train --model {cfg.model} --budget {cfg.budget} {given} plans and applies them")
    return plan


def _plot(cfg: PlanConfig, plan: memfit.Plan) -> None:
    if not cfg.plot:
        return
    title = (
        f"{cfg.model}, world size {cfg.world_size}: peak {format_bytes(plan.predicted_peak)} at {plan.forecast['at']}"
    )
    plot_timeline(plan.timeline(), plan.budget, cfg.plot, title)
    print(f"wrote the plot {cfg.plot}" + (f" (its numbers: 'timeline' in {cfg.json})" if cfg.json else ""))


def auto_command(cfg: PlanConfig, model: torch.nn.Module, batch, device: memfit.DeviceProfile) -> memfit.Plan:
    """`memfit plan --auto`: the configurations searched, why each lost, and the chosen one's plan."""
    global_batch = f"global batch {cfg.global_batch}" if cfg.global_batch else "no global batch (accumulation 1)"
    with phase("plan", f"searching configurations for {cfg.budget} per rank, {global_batch}") as progress:
        result = memfit.autoconfigure(
            model,
            batch,
            budget=cfg.budget,
            world_size=cfg.world_size,
            global_batch=cfg.global_batch,
            device_profile=device,
            shard_sizes=[cfg.shard_size] if cfg.shard_size else None,
            **tier_options(cfg),
            mixed_precision=mixed_precision(cfg.mixed_precision),
            progress=progress,
        )
    print(result.table(limit=20))
    print()
    print(chosen_plan_table(result))
    if cfg.json:
        write_json(cfg.json, {"auto": result.to_dict(), "plan": result.plan.to_dict()})
    _plot(cfg, result.plan)
    # memfit train --auto searches the same way on the first batch of its data (every layout)
    flags = {"model": cfg.model, "layers": cfg.layers, "hidden": cfg.hidden, "seq": cfg.seq, "budget": cfg.budget}
    flags.update(global_batch=cfg.global_batch, mixed_precision=None if cfg.mixed_precision == "no" else "bf16")
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items() if v is not None)
    launcher = f"torchrun --nproc-per-node {cfg.world_size} -m memfit" if cfg.world_size > 1 else "memfit"
    print("\nthe times above are priced, not measured: with --trials K, memfit train times the top K first")
    print(f"run it: {launcher} train --auto {args}")
    return result.plan


def chosen_plan_table(result: memfit.AutoConfig) -> str:
    """The chosen configuration's plan table; where its predicted step differs from the
    configuration's (the table above), its line says why: the plan prices one micro-batch's
    step, the search the whole optimizer step at its layout."""
    best, lines = result.best, result.plan.table().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("time on ") and ": predicted step " in line:
            said = line.split(": predicted step ", 1)[1].split(" ms", 1)[0]
            if said != f"{best.step_time * 1e3:.1f}":
                lines[i] = (
                    f"{line}; the plan's own step (micro-batch {best.micro_batch}, as memfit.plan prices it), not the "
                    f"configuration's {best.step_time * 1e3:.1f} ms above ({best.accumulation} micro-batches, the "
                    f"optimizer and the communication of {best.layout.describe()})"
                )
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _device_profile(name: str | None) -> tuple[memfit.DeviceProfile, str]:
    """The profile ``--device-profile`` names, or the default: the named profile of this
    machine's accelerator, or "cpu" (never a cached calibration: see [Note: The default device
    profile]); with the reason, for the header."""
    from memfit._plan._calibrate import device_profile

    if name is not None:
        profile = device_profile(name)
        return profile, profile.source or "--device-profile"
    target = "cuda" if torch.cuda.is_available() else "cpu"
    profile = default_profile(target)
    return profile, (
        f"the default for this machine's {target}, {profile.source}; --device-profile h100|h200|a100|cpu names "
        "the target, 'calibrated' measures this machine"
    )


# [Note: From a plan to a run]
# `memfit train` takes one --checkpointing kind for every block, or a plan's per-block decisions
# (--plan FILE) when they are kinds it runs (keep, selective or full; not offload, untested under
# sharding), and computes its loss with the head whole. So with --json FILE and such a plan (head
# whole), the run `memfit plan` hands over is `--plan FILE`; otherwise the uniform kind of least
# predicted extra time whose forecast (Plan.fixed, plain head) fits the budget, else full, its
# own forecast printed beside it, so the user sees what the uniform kind costs against the
# plan. The command's flags (model, sizes, layout) are those that planned.
def run_lines(cfg: PlanConfig, plan: memfit.Plan, seq: int, rows: int) -> list[str]:
    """What runs the plan: `memfit train`'s flags (or, with --emit, its --config file), with the
    uniform kind's forecast. See [Note: From a plan to a run]."""
    kind, uniform = _uniform_kind(plan)
    assert plan.budget is not None  # a solved plan
    fits = "fits" if uniform.predicted_peak <= plan.budget else "does not fit"
    flags: dict[str, object] = {"model": cfg.model, "layers": cfg.layers, "hidden": cfg.hidden, "seq": seq}
    flags.update(batch=rows, checkpointing=kind, hybrid_shards=cfg.shard_size or 0)
    flags.update(mixed_precision=cfg.mixed_precision if cfg.mixed_precision != "no" else None)
    flags.update(clip=cfg.clip if cfg.clip != 1.0 else None)  # (memfit train's default otherwise)
    flags = {k: v for k, v in flags.items() if v not in (None, 0)}
    launcher = f"torchrun --nproc-per-node {cfg.world_size} -m memfit" if cfg.world_size > 1 else "memfit"
    budget = describe_bytes(plan.budget)
    dtype = "" if cfg.dtype == "fp32" else f"; it trains in fp32, which this {cfg.dtype} forecast does not cover"
    lines = [
        "",
        f"memfit train applies one kind to every block: --checkpointing {kind} predicts "
        f"{format_bytes(uniform.predicted_peak)} ({fits} {budget}), {uniform.predicted_overhead * 1e3:.1f} ms of "
        f"recompute a step{dtype}",
    ]
    needs = sorted({k for k in plan.decisions.values() if k not in PLANNED_KINDS})
    why = [f"{' and '.join(needs)} blocks"] * bool(needs) + ["a chunked head"] * (plan.head == "chunked")
    if fits == "does not fit" and why:
        lines.append(
            f"memfit train cannot run this plan within the budget: it needs {' and '.join(why)}, which memfit "
            "train does not apply (plan.apply(model) does, in your own loop); the closest run, over the budget:"
        )
    elif fits == "does not fit" and not cfg.json:
        lines.append("its per-block kinds fit: add --json plan.json, and memfit train --plan plan.json applies them")
    if cfg.json and plan.head == "plain" and all(k in PLANNED_KINDS for k in plan.decisions.values()):
        del flags["checkpointing"]  # the plan's own per-block decisions, as saved
        flags["plan"] = cfg.json
        lines = ["", f"memfit train --plan {cfg.json} applies these per-block decisions (forecast above)"]
    if cfg.emit:
        with open(cfg.emit, "w") as f:
            f.write("# memfit train --config: the run `memfit plan` chose\n[train]\n")
            f.writelines(f"{k.replace('_', '-')} = {json.dumps(v)}\n" for k, v in flags.items())
        return [*lines, f"run it: {launcher} train --config {cfg.emit}"]
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    return [*lines, f"run it: {launcher} train {args}"]


def _uniform_kind(plan: memfit.Plan) -> tuple[str, memfit.Plan]:
    """The kind `memfit train --checkpointing` takes of least predicted extra time that fits."""
    options = []
    for kind in (k.value for k in memfit.DecisionKind if k.spec.train_applies):
        if kind in plan.profile.blocks[0].kept:
            options.append((kind, memfit.Plan.fixed(dict.fromkeys(plan.decisions, kind), plan.profile, plan.sharding)))
    assert plan.budget is not None
    fitting = [o for o in options if o[1].predicted_peak <= plan.budget]
    return min(fitting, key=lambda o: o[1].predicted_overhead) if fitting else options[-1]


def _calibrate_rank(rank: int, world_size: int) -> memfit.DeviceProfile:
    from memfit._plan._calibrate import calibrate_group

    return calibrate_group()  # on the device spawn placed this rank on (gloo: the CPU; NCCL: its GPU)


def calibrate_command(cfg: CalibrateConfig) -> memfit.DeviceProfile:
    """Measure this machine's rates for the planner's time model and cache them; with
    ``--world-size W`` W spawned ranks measure together (each rank's share of the machine and
    the links between them; see [Note: Calibrating the links])."""
    how = ""
    if cfg.world_size > 1:
        from memfit.cli._launch import spawn

        profile = spawn(_calibrate_rank, cfg.world_size, device=cfg.device, where="memfit calibrate")
        save_profile(profile, torch.device(cfg.device).type)
        how = f" (measured by {cfg.world_size} ranks together)"
    else:
        threads = torch.get_num_threads()
        if cfg.cpu_time:
            torch.set_num_threads(1)
        try:
            if torch.device(cfg.device).type == "cuda":  # See [Note: Calibrating an accelerator]
                from memfit._plan._calibrate_device import calibrate_device

                # the named profile's rates beside the cache (a checkout's benchmarks/results/
                # is where the GPU validation commits them for the named profile to read)
                profile, written = calibrate_device(cfg.device, results=cache_path("cuda").parent)
                save_profile(profile, "cuda")
                how = f"; the named profile's measured rates in {written}"
            else:
                profile = calibrate(cfg.device, cpu_time=cfg.cpu_time)
        finally:
            torch.set_num_threads(threads)
    print(json.dumps(asdict(profile), indent=1))
    print(
        f"cached in {cache_path(torch.device(cfg.device).type)}{how}: plan with it by "
        "`memfit plan ... --device-profile calibrated`"
    )
    return profile
