"""The time model against every GPU row measured on the H100 (benchmarks/results/gpu_h100.json,
parts b and c): each row's model traced here, on this CPU host, on the meta device (fake
tensors), priced on the named "h100" profile, beside the step the H100 measured.

Rows: part b, BERT-large MLM (seq 512, batch 16, dropout 0.1, AdamW), fp32 and under bf16
autocast: none, memfit full, memfit selective (save="matmul"), memfit offload, memfit planned
(the decisions the H100's plan took); part c, at one rank: plain, torch FSDP2 and memfit's
FullyShardedDataParallel (each layer a unit), fp32 and bf16 (plain: autocast; memfit and FSDP2:
MixedPrecision(bf16, fp32)), on BERT-large (batch 8) and llama-1b (seq 2048, batch 1).

A row's prediction ([Note: Host and device time] in memfit/_plan/_time.py):
    step = max(host + hooks, device) of the forward and backward + that of the optimizer step
           + per block the decision's extra time (the block's region under it less under keep)
    hooks: memfit's units at one rank, shard_unit per unit + shard_param per parameter; FSDP2's
           rows are priced with memfit's figures (its hooks are of the same kind: a test of
           carrying them over, none of its rows fitted).

Rows timed after torch.profiler had run in the process (at the committed run's commit, every
part c row but the first: part c profiles each row after timing it; part b ran no profiler)
pay CUPTI's callbacks per kernel launch, priced as profiled_launch x the launches of the traced
stream ([Note: Host and device time]); a plan never prices them.

The free figures are fitted on FIT_ROWS (6 of 22 rows, a third at most), each by bisection on the
row it is named with, in order; the device rates on the kernel time the profiler summed for
that row (part c's kernel_us), the host costs on the step. ``--fit`` prints them for
memfit/_plan/_time.py's _H100_FIT; without it the committed profile prices every row, fitted
and held-out rows reported apart.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_time_rows.py [--fit] [--out benchmarks/results/gpu_time_rows.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command, emit

import memfit
from memfit._plan._profile import profile_model
from memfit._plan._time import PROFILES, DeviceProfile, OpCost
from memfit.models import PRESETS, Shape, bert_mlm, lm_batch, mlm_batch

RESULTS = Path(__file__).resolve().parent / "results"
BF16 = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
# (row, the constant fitted on it, what it is fitted to: "step" or "kernels")
# (row, the figure fitted on it, to what: "kernels": the model's device time to the kernel time
# the profiler summed for the row; "host": the model's host time to the measured step, on rows
# the host bounds (their kernel time is half their step or less, or, in part b, the wrappers'
# cost the issue names))
FIT_ROWS = [
    ("c bert-large fp32 plain", "float32", "kernels"),
    ("b bf16 autocast none", "host_op", "host"),
    ("c bert-large bf16 plain", "profiled_launch", "host"),
    ("b bf16 autocast memfit full", "checkpoint_block", "host"),
    ("b bf16 autocast memfit selective", "selective_op", "host"),
    ("c bert-large bf16 memfit", "shard_unit", "host"),
]
PASSES = 1  # each figure once, in order (the rates on device time, the host's costs on host time)
RATES = ("float32", "bfloat16", "attention_float32")  # the step falls as these grow


class _Recording(DeviceProfile):
    """A profile that keeps every region the profile prices on it, to price them again on others."""

    def decision_time(self, decision: str, costs: list[OpCost], keep: list[OpCost]) -> float:
        _SEEN.setdefault("decisions", {})[decision] = (costs, keep)
        return super().decision_time(decision, costs, keep)

    def ops_time(self, costs: list[OpCost], host_extra: float = 0.0) -> float:
        _SEEN["last"] = costs
        return super().ops_time(costs, host_extra)

    def split(self, costs: list[OpCost], host_extra: float = 0.0) -> tuple[float, float]:
        # the profile prices the forward and backward, then the optimizer step, then splits the first
        _SEEN["forward_backward"], _SEEN["optimizer"] = costs, _SEEN["last"]
        return super().split(costs, host_extra)


_SEEN: dict = {}


@dataclasses.dataclass
class Traced:
    """The op costs of one model's step, to price on any profile."""

    forward_backward: list[OpCost]
    optimizer: list[OpCost]
    decisions: dict[str, tuple[list[OpCost], list[OpCost]]]
    blocks: int
    params: int
    input_bytes: int


def trace(model, batch, *, autocast: bool, mixed: bool, rule: str = "matmul") -> Traced:
    _SEEN.clear()
    rec = _Recording(**{f.name: getattr(PROFILES["h100"], f.name) for f in dataclasses.fields(DeviceProfile)})
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        prof = profile_model(
            model, batch, None, rule=rule, device=rec, chunk_head=False, mixed_precision=BF16 if mixed else None,
            decisions=("keep", "full", "selective", "offload"),
        )  # fmt: skip
    assert prof.distinct_blocks == 1, "the rows' models have identical layers"
    params = sum(1 for p in model.parameters() if p.requires_grad)
    decisions, opt = dict(_SEEN["decisions"]), _SEEN["optimizer"]  # AdamW as the target runs it (foreach on CUDA)
    return Traced(_SEEN["forward_backward"], opt, decisions, len(prof.blocks), params, prof.blocks[0].input_bytes)


def _models() -> dict[str, tuple]:
    """Per trace key: (model on the meta device, batch, autocast, mixed precision, selective's rule)."""
    b_shape = Shape(layers=24, hidden=1024, heads=16, seq=512, batch=16, vocab=30522)
    with torch.device("meta"):
        bert = bert_mlm(b_shape)
        built = {name: PRESETS[name].build() for name in ("bert-large", "llama-1b")}
    out = {}
    for ac in (False, True):
        out[f"b {'bf16 autocast' if ac else 'fp32'}"] = (bert, mlm_batch(b_shape), ac, False, "matmul")
    for name, model in built.items():
        preset = PRESETS[name]
        batch = (mlm_batch if preset.arch == "bert" else lm_batch)(preset.shape)
        out[f"c {name} fp32"] = (model, batch, False, False, "matmul")
        out[f"c {name} bf16 autocast"] = (model, batch, True, False, "matmul")
        out[f"c {name} bf16 mixed"] = (model, batch, False, True, "matmul")
    for ac in (False, True):  # the H100's planned rows: memfit.plan's default rule
        out[f"b {'bf16 autocast' if ac else 'fp32'} linear"] = (bert, mlm_batch(b_shape), ac, False, "linear")
    return out


def traces(cache: Path | None, planned_rule: bool = True) -> dict[str, Traced]:
    """Every row's trace; ``cache``: a pickle written after each (tracing takes minutes);
    ``planned_rule``: trace the planned rows with memfit.plan's rule too (else the matmul one's)."""
    out: dict[str, Traced] = pickle.loads(cache.read_bytes()) if cache and cache.exists() else {}
    for key, (model, batch, ac, mixed, rule) in _models().items():
        if key in out or (key.endswith(" linear") and not planned_rule):
            continue
        out[key] = trace(model, batch, autocast=ac, mixed=mixed, rule=rule)
        print(f"traced {key}", file=sys.stderr, flush=True)
        if cache:
            cache.write_bytes(pickle.dumps(out))
    return out


def price(
    t: Traced, device: DeviceProfile, decisions: dict[str, int], hooks: float = 0.0, profiled: bool = False
) -> dict[str, float]:
    """The step of ``t`` on ``device`` with ``decisions`` (kind -> blocks; the rest kept) and
    host ``hooks`` seconds beside its forward and backward ops (``profiled``: timed after
    torch.profiler ran in the process: CUPTI's cost per launch too); and the step's host and
    device seconds apart (what the decisions add to each included)."""
    cupti = device.profiled_time if profiled else (lambda costs: 0.0)
    host, dev = device.split(t.forward_backward, hooks + cupti(t.forward_backward))
    opt_host, opt_dev = device.split(t.optimizer, cupti(t.optimizer))
    step = max(host, dev) + max(opt_host, opt_dev)
    host, dev = host + opt_host, dev + opt_dev
    for kind, n in decisions.items():
        if kind == "keep":
            continue
        costs, keep = t.decisions["full" if kind == "offload" else kind]
        one = device.decision_time("full" if kind == "offload" else kind, costs, keep)
        if kind == "offload":
            forward = device.ops_time(keep) / 3  # a block's forward: a third of its kept region
            one += device.offload_time(t.input_bytes, forward)
        hooks_d = device.checkpoint_time(len(costs) - len(keep)) + (
            device.selective_op * len(costs) * (kind == "selective")
        )
        (h_d, d_d), (h_k, d_k) = device.split(costs, hooks_d), device.split(keep)
        step, host, dev = step + n * one, host + n * (h_d - h_k), dev + n * (d_d - d_k)
    return {"step": step, "host": host, "device": dev}


def measured_rows() -> list[dict]:
    """Every row of parts b and c: name, its trace key, decisions, hooks kind, measured step and kernels."""
    data = json.loads((RESULTS / "gpu_h100.json").read_text())["parts"]
    rows = []
    for tag, res in data["b"]["figures"]["results"].items():
        for strategy, r in res.items():
            if strategy == "torch.utils.checkpoint" or "step_s" not in r:
                continue
            kind = strategy.removeprefix("memfit ")
            n = 24
            decisions = dict(r["decisions"]) if kind == "planned" else ({} if kind == "none" else {kind: n})
            key = f"b {tag}" + (" linear" if kind == "planned" else "")
            rows.append({"row": f"b {tag} {strategy}", "trace": key, "decisions": decisions, "hooks": None,
                         "step": r["step_s"], "kernels": None, "profiled": False})  # fmt: skip
    for label, res in data["c"]["figures"]["results"].items():
        name, dtype = label.rsplit(" ", 1)
        for strategy, r in res.items():
            if "step_s" not in r:
                continue
            bf16 = dtype == "bf16"
            key = f"c {name} " + ("fp32" if not bf16 else "bf16 autocast" if strategy == "plain" else "bf16 mixed")
            hooks = {"plain": None, "memfit": "memfit", "torch FSDP2": "fsdp2"}[strategy]
            # timed after an earlier row's profiled step: every part c row but the first
            profiled = any(x["row"].startswith("c ") for x in rows)
            rows.append({"row": f"c {label} {strategy}", "trace": key, "decisions": {}, "hooks": hooks,
                         "step": r["step_s"], "kernels": r["kernel_us"] / 1e6, "profiled": profiled})  # fmt: skip
    return rows


def _trace_of(row: dict, traced: dict[str, Traced]) -> Traced:
    """The row's trace; a planned row without its own (memfit.plan's "linear" rule), the matmul one's."""
    return traced.get(row["trace"]) or traced[row["trace"].removesuffix(" linear")]


def predict(row: dict, t: Traced, device: DeviceProfile) -> dict[str, float]:
    hooks = device.shard_hooks(t.blocks + 1, t.params) if row["hooks"] else 0.0  # memfit's or FSDP2's units
    return price(t, device, row["decisions"], hooks, row["profiled"])


def fit(rows: list[dict], traced: dict[str, Traced]) -> DeviceProfile:
    """The free figures, each by bisection on its row (see FIT_ROWS), in order."""
    device = PROFILES["h100"]
    by_name = {r["row"]: r for r in rows}
    for name, constant, target in FIT_ROWS * PASSES:
        row = by_name[name]
        goal = row["kernels"] if target == "kernels" else row["step"]

        def value(x: float, constant=constant, row=row, target=target, device=device) -> float:
            p = predict(row, _trace_of(row, traced), _with(device, constant, x))
            return p[{"kernels": "device", "host": "host", "step": "step"}[target]]

        rising = constant not in RATES  # a rate: the step falls as it grows
        lo, hi = (1e-9, 1e-2) if rising else (1e12, 2e15)  # host_op stays > 0: the overlapped model
        for _ in range(100):
            mid = (lo + hi) / 2 if rising else (lo * hi) ** 0.5
            above = value(mid) > goal
            lo, hi = (lo, mid) if above == rising else (mid, hi)
        x = (lo + hi) / 2 if rising else (lo * hi) ** 0.5
        device = _with(device, constant, x)
        print(f"{constant} = {x:.4g}  (on {name}, {target} {goal:.4f} s)", file=sys.stderr)
    return device


def _figure(device: DeviceProfile, constant: str) -> float:
    if constant == "attention_float32":
        return device.attention_flops.get("float32", 0.0)
    return device.flops[constant] if constant in device.flops else getattr(device, constant)


def _with(device: DeviceProfile, constant: str, x: float) -> DeviceProfile:
    """``device`` with one figure set: a matmul rate (a dtype's name) or a field."""
    if constant == "attention_float32":
        return dataclasses.replace(device, attention_flops=dict(device.attention_flops) | {"float32": x})
    if constant in ("float32", "bfloat16"):
        half = {"float16": x} if constant == "bfloat16" else {}
        return dataclasses.replace(device, flops=dict(device.flops) | {constant: x} | half)
    return dataclasses.replace(device, **{constant: x})


def report(rows: list[dict], traced: dict[str, Traced], device: DeviceProfile, caching: str = "") -> list[str]:
    """The table of every row, predicted beside measured (``caching``: flags left out of the command shown)."""
    fitted = {name for name, *_ in FIT_ROWS}
    lines = [
        "# The time model against the H100's rows (gpu_h100.json parts b and c)",
        "",
        command("gpu_time_rows.py").replace(caching, ""),
        "(add `--cache FILE` to keep the traces: about 25 s of CPU each, ten of them; `--fit` refits).",
        "",
        f"Traced on this CPU host (fake tensors), priced on the named profile {device.name!r} "
        f"([Note: Host and device time]). Fitted rows (marked fit) set one figure each: "
        + "; ".join(f"{c} on {n} ({t})" for n, c, t in FIT_ROWS)
        + ". Held-out rows set nothing. (profiled): timed after torch.profiler ran in the process, priced "
        "with profiled_launch per kernel launch (CUPTI stays attached: pytorch/pytorch#144455).",
        "",
        "| row | fit/held-out | measured step s | predicted step s | predicted/measured | host s | device s "
        "| measured kernels s | within +-15% |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    ratios: dict[str, list[float]] = {"fit": [], "held-out": []}
    for row in rows:
        p = predict(row, _trace_of(row, traced), device)
        kind = "fit" if row["row"] in fitted else "held-out"
        r = p["step"] / row["step"]
        ratios[kind].append(r)
        k = f"{row['kernels']:.4f}" if row["kernels"] is not None else "-"
        mark = " (profiled)" if row["profiled"] else ""
        lines.append(
            f"| {row['row']} | {kind}{mark} | {row['step']:.4f} | {p['step']:.4f} | {r:.2f} | {p['host']:.4f} "
            f"| {p['device']:.4f} | {k} | {'yes' if abs(r - 1) <= 0.15 else 'no'} |"
        )
    lines.append("")
    for kind, rs in ratios.items():
        within = sum(abs(r - 1) <= 0.15 for r in rs)
        lines.append(
            f"- {kind}: {within}/{len(rs)} rows within +-15%; predicted/measured median "
            f"{statistics.median(rs):.2f}, range {min(rs):.2f}-{max(rs):.2f}"
        )
    lines.append("- fitted figures: " + ", ".join(f"{k} {_figure(device, k):.4g}" for _, k, _ in FIT_ROWS))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="fit the free figures on FIT_ROWS and report with them")
    p.add_argument("--out")
    p.add_argument("--cache", help="a pickle of the traced rows (traced once, priced many times)")
    p.add_argument("--no-trace", action="store_true", help="price only what --cache holds (trace nothing)")
    p.add_argument("--planned-as-selective", action="store_true", help="price the planned rows on the matmul rule")
    args = p.parse_args()
    cache = Path(args.cache) if args.cache else None
    caching = (" --no-trace" if args.no_trace else "") + (f" --cache {args.cache}" if args.cache else "")
    traced = (
        pickle.loads(cache.read_bytes()) if args.no_trace and cache else traces(cache, not args.planned_as_selective)
    )
    rows = measured_rows()
    device = fit(rows, traced) if args.fit else PROFILES["h100"]
    emit(report(rows, traced, device, caching), args.out)


if __name__ == "__main__":
    main()
