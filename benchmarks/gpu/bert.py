"""Part b: the seed's experiment. OneFlow trained BERT-large (L=24, h=1024, 16 heads) on one
RTX 3090 and reported 9141 MB -> 5978 MB (-34.6%) average memory for 25m16s -> 33m36s (+33%)
with activation checkpointing.

Here: BertForMaskedLM (random init, dropout 0.1, sdpa attention), seq 512, AdamW, a batch that
makes the plain step take tens of GB (``--bert-batch``, default 16: the planner forecasts
73 GiB for the plain fp32 step at 32, too close to an H100's 79), in fp32 and under bf16
autocast; per strategy a fresh copy on the device, one at a time:

    none, memfit full, memfit selective (save="matmul"), memfit offload (inputs to pinned host
    memory), memfit planned (memfit.plan at budget = none's peak x 5978/9141), and
    torch.utils.checkpoint (transformers' gradient_checkpointing_enable, non-reentrant).

Figures: max_memory_allocated / max_memory_reserved of one step (after warm-up, AdamW state
included), MemoryMeter's live peak, the activation bytes kept after the forward, the median
step time of ``repeats`` steps after ``warmup`` (device events), tokens/s.

Goals: full saves >= 34.6% of none's peak at <= 1.33x its time; planned saves as much at
<= 1.20x; selective saves >= 30% of the kept activations at <= 1.10x; memfit full within 1%
of torch.utils.checkpoint's peak and time. The planner forecasts for fp32 compute: under
autocast its plan is conservative.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import Counter

import torch

import memfit
from benchmarks.gpu._env import Env, errors_of, fmt, goal, mib, profile_errors, ratio, timed_after_profiler
from memfit.models import Shape, bert_layer_class, bert_mlm, mlm_batch

STRATEGIES = ("none", "memfit full", "memfit selective", "memfit offload", "memfit planned", "torch.utils.checkpoint")
SEED_RATIO = 5978 / 9141
PROFILES: dict[
    tuple, object
] = {}  # the planner's profile of BERT per (device, batch shape)  # the seed's memory after / before checkpointing


SMOKE = Shape(layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=128)


def shape_of(env: Env) -> Shape:
    if env.smoke:
        return SMOKE
    return Shape(layers=24, hidden=1024, heads=16, seq=512, batch=env.bert_batch or 16, vocab=30522)


def prepare(strategy: str, base: torch.nn.Module, env: Env, batch: dict, budget: int | None) -> tuple:
    """A copy of ``base`` on the device with ``strategy`` applied, and what the planner said."""
    model = copy.deepcopy(base).to(env.device).train()
    layer = bert_layer_class()
    info = {}
    if strategy == "memfit full":
        memfit.Decision("full").apply_to(model, layer)
    elif strategy == "memfit selective":
        memfit.Decision("selective", save="matmul").apply_to(model, layer)
    elif strategy == "memfit offload":
        memfit.Decision("offload", offload="cpu").apply_to(model, layer)
    elif strategy == "memfit planned":
        key = (str(env.device), tuple(batch["input_ids"].shape))
        plan = memfit.plan(model, batch, budget=budget, profile=PROFILES.get(key))
        PROFILES[key] = plan.profile  # the same model and batch: re-planned, not measured again
        plan.apply(model)
        info = {
            "budget": budget,
            "predicted_peak": plan.predicted_peak,
            "predicted_overhead": plan.predicted_overhead,
            "decisions": dict(Counter(str(d) for d in plan.decisions.values())),
        }
    elif strategy == "torch.utils.checkpoint":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, info


def _build(strategy: str, base, env: Env, batch: dict, dtype: torch.dtype, budget: int | None):
    """The row's model and optimizer, and its step; ``kept`` and ``losses`` as the step fills them."""
    model, info = prepare(strategy, base, env, batch, budget)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept, losses = [0], []

    def step() -> None:
        before = env.allocated()
        with env.autocast(dtype):
            loss = model(**batch).loss
        kept[0] = env.allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return model, opt, info, step, kept, losses


def _offload_here(strategy: str, env: Env):
    from memfit.testing import host_offload_on_cpu

    cpu_offload = strategy in ("memfit offload", "memfit planned") and not env.cuda
    return host_offload_on_cpu() if cpu_offload else _null()


def _tag(strategy: str, dtype: torch.dtype) -> str:
    return f"b-{'fp32' if dtype == torch.float32 else 'bf16'}-{strategy.replace(' ', '_')}"


def measure(strategy: str, base, env: Env, batch: dict, dtype: torch.dtype, budget: int | None, tokens: int) -> dict:
    """The first pass: time, peaks, MemoryMeter and the peak's snapshot; no profiler (see
    [Note: Time before profiling] in benchmarks/gpu/sharding.py)."""
    from benchmarks.gpu._memsnap import record_peak

    before = env.profiler_sessions
    with _offload_here(strategy, env):
        model, opt, info, step, kept, losses = _build(strategy, base, env, batch, dtype, budget)
        warmup, repeats = (0, 1) if env.smoke else (2, 5)
        seconds = env.median_time(step, warmup, repeats)
        peaks = env.allocator_peaks(step) if env.cuda else {"max_allocated": None, "max_reserved": None}
        with memfit.MemoryMeter(model=model, optimizer=opt) as meter:
            step()
        snapshot = record_peak(env, step, _tag(strategy, dtype))
    return {
        **peaks,
        "meter_peak": meter.peak_bytes,
        "kept_after_forward": kept[0] if env.cuda else None,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "first_loss": losses[0].item(),
        "profiler_sessions_before": before,
        "peak_snapshot": snapshot,
        **info,
    }


def profile_row(strategy: str, base, env: Env, batch: dict, dtype: torch.dtype, row: dict) -> dict:
    """The second pass: the row built again (the same budget), one warm-up step, one profiled
    step: the diagnosis (busy share, host time, the op fixture)."""
    from benchmarks.gpu.sharding import profile_step

    with _offload_here(strategy, env):
        *_, step, _, _ = _build(strategy, base, env, batch, dtype, row.get("budget"))
        step()
        prof = profile_step(env, step, _tag(strategy, dtype))
    seconds = row["step_s"]
    return {**prof, "busy_share": prof["kernel_us"] / 1e6 / seconds, "host_share": prof["host_us"] / 1e6 / seconds}


def _null():
    import contextlib

    return contextlib.nullcontext()


def peak(r: dict) -> int:
    return r["max_allocated"] if r.get("max_allocated") is not None else r["meter_peak"]


def run(env: Env) -> dict:
    shape = shape_of(env)
    sessions_at_start = env.profiler_sessions
    results: dict[str, dict[str, dict]] = {}
    for _attempt in range(3):  # halve the batch when the plain fp32 step does not fit
        results = {}
        tokens = shape.batch * shape.seq
        base = bert_mlm(shape)
        batch = {k: v.to(env.device) for k, v in mlm_batch(shape).items()}
        try:
            for dtype in (torch.float32, torch.bfloat16):
                label = "fp32" if dtype == torch.float32 else "bf16 autocast"
                rows = results.setdefault(label, {})
                for strategy in STRATEGIES if not (env.smoke and dtype != torch.float32) else STRATEGIES[:1]:
                    env.log(f"  b: {label} {strategy} (batch {shape.batch})")
                    none = rows.get("none", {"error": "not measured"})
                    # smoke: a budget a plan fits (a tiny model's head and state leave nothing to save)
                    scale = 2.0 if env.smoke else SEED_RATIO
                    budget = int(peak(none) * scale) if "error" not in none else None  # planned only
                    try:
                        rows[strategy] = measure(strategy, base, env, batch, dtype, budget, tokens)
                    except torch.cuda.OutOfMemoryError as e:
                        if strategy == "none" and dtype == torch.float32:
                            raise
                        rows[strategy] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                    except Exception as e:  # recorded; the other strategies still run
                        rows[strategy] = {"error": f"{type(e).__name__}: {e}"}
                    env.free()
            profile_rows(env, base, batch, results)
            return report(env, shape, results, sessions_at_start)
        except torch.cuda.OutOfMemoryError:
            pass  # the tensors the error holds are freed once its handler is left
        env.free()
        shape = dataclasses.replace(shape, batch=shape.batch // 2)
    raise RuntimeError(f"BERT-large's plain fp32 step did not fit at batch {shape.batch * 2} or above")


def profile_rows(env: Env, base, batch: dict, results: dict) -> None:
    """The second pass over every row timed (both dtypes): its diagnosis, or ``profile_error``."""
    for label, rows in results.items():
        dtype = torch.float32 if label == "fp32" else torch.bfloat16
        for strategy, r in rows.items():
            if "error" in r:
                continue
            env.log(f"  b: {label} {strategy} (profiled)")
            try:
                rows[strategy] = r | profile_row(strategy, base, env, batch, dtype, r)
            except Exception as e:  # recorded; the other rows still get theirs
                r["profile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            env.free()


def report(env: Env, shape: Shape, results: dict, sessions_at_start: int = 0) -> dict:
    md = [
        f"BertForMaskedLM {shape}, AdamW, dropout 0.1; median of 5 steps after 2 warm-up (device events). "
        "Peaks of one step with AdamW state. kept: activation bytes alive after the forward.",
        "",
        "| dtype | strategy | max allocated MiB | max reserved MiB | MemoryMeter MiB | kept MiB | step s | tokens/s "
        "| peak vs none | time vs none | first loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    goals = []
    for label, rows in results.items():
        none = rows.get("none", {})
        base_peak = peak(none) if "step_s" in none else None
        for name, r in rows.items():
            if "error" in r:
                md.append(f"| {label} | {name} | {r['error']} |||||||||")
                continue
            md.append(
                f"| {label} | {name} | {mib(r['max_allocated'])} | {mib(r['max_reserved'])} | {mib(r['meter_peak'])} "
                f"| {mib(r['kept_after_forward'])} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} "
                f"| {fmt(ratio(peak(r), base_peak))} | {fmt(ratio(r['step_s'], none.get('step_s')))} "
                f"| {r['first_loss']:.4f} |"
            )
        if "error" in none or not none:
            goals.append(goal(f"{label}: none measured", None, "fits", False))
            continue
        goals += goals_of(label, rows)
        if "step_s" in rows.get("memfit planned", {}):
            pl = rows["memfit planned"]
            md.append("")
            scale = "2 (smoke)" if env.smoke else "5978/9141"
            md.append(
                f"- {label} planned: budget {mib(pl['budget'])} MiB (none's peak x {scale}), predicted "
                f"{mib(pl['predicted_peak'])} MiB, measured {mib(peak(pl))} MiB; decisions {pl['decisions']}"
            )
    return {
        "figures": {
            "shape": dataclasses.asdict(shape),
            "results": results,
            "errors": errors_of(results) | profile_errors(results),
            "timed_after_profiler": timed_after_profiler(results, sessions_at_start),
        },
        "goals": goals,
        "markdown": md,
    }


def goals_of(label: str, rows: dict[str, dict]) -> list[dict]:
    """The issue's goals for one dtype's rows (none measured)."""
    none = rows["none"]
    goals = []

    def ok(name):
        return name in rows and "error" not in rows[name]

    def saving(name):
        return 1 - peak(rows[name]) / peak(none)

    def slow(name):
        return rows[name]["step_s"] / none["step_s"]

    for name, most in (("memfit full", 1.33), ("memfit planned", 1.20)):
        if ok(name):
            s, t = saving(name), slow(name)
            goals.append(goal(f"{label}: {name} saves", s, ">= 0.346", s >= 0.346))
            goals.append(goal(f"{label}: {name} time vs none", t, f"<= {most}", t <= most))
        else:
            goals.append(goal(f"{label}: {name} ran", None, "no error", False))
    if ok("memfit selective"):
        sel = rows["memfit selective"]
        if none["kept_after_forward"]:
            s = 1 - sel["kept_after_forward"] / none["kept_after_forward"]
        else:  # the CPU: MemoryMeter's peaks stand in
            s = saving("memfit selective")
        goals.append(goal(f"{label}: selective saves of activations", s, ">= 0.30", s >= 0.30))
        goals.append(
            goal(
                f"{label}: selective time vs none",
                slow("memfit selective"),
                "<= 1.10",
                slow("memfit selective") <= 1.10,
            )
        )
    if ok("memfit full") and ok("torch.utils.checkpoint"):
        full, ref = rows["memfit full"], rows["torch.utils.checkpoint"]
        p, t = peak(full) / peak(ref), full["step_s"] / ref["step_s"]
        goals.append(goal(f"{label}: memfit full peak vs torch's", p, "<= 1.01", p <= 1.01))
        goals.append(goal(f"{label}: memfit full time vs torch's", t, "<= 1.01", t <= 1.01))
    return goals
