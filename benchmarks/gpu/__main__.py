"""``python -m benchmarks.gpu [--time-budget 540] [--out DIR] [--smoke] [--parts adf...]``: see
benchmarks/gpu/__init__.py."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu._env import Env, device_name, fmt

# letter -> (module, title, seconds it may take on one H200 before it is stopped): the first
# H100 call's times (a 45, b 69, c 68, e 36, f 52 s; d stopped early by its out-of-memory) with
# room for what this validation adds (bf16 diagnosis and profiles, async saves, 6 trials; b and
# c build every row twice, timed then profiled, and record one step's allocator history).
PARTS = {
    "a": ("correctness", "Correctness on the device", 70),
    "b": ("bert", "The seed's experiment: BERT-large MLM, seq 512", 90),
    "c": ("sharding", "Sharding at W=1 on NCCL: plain vs FSDP2 vs memfit", 80),
    "d": ("planner", "Planner and meter against the allocator", 60),
    "e": ("offload", "Offload: pinned copies, offload='cpu' vs save_on_cpu", 40),
    "f": ("train", "memfit train --device cuda --async-save, resumed once", 55),
    "g": ("autoconfig", "autoconfigure's top configurations tried on the device", 70),
    "h": ("two_ranks", "Two ranks on one GPU over gloo: sharded BERT against one process", 60),
    "i": ("calibrate", "memfit calibrate on the device: the time model's rates", 40),
    "j": ("host_tier", "The host tier: memfit.host_optimizer vs FSDP2's CPUOffloadPolicy", 60),
}
# Most valuable first (issue 48): correctness; the re-checks of the misses the first run found
# (d's memory, f's checkpoints, now with --async-save); bf16 speed with its diagnosis; the time
# model's calibration; autoconfigure's ranking; two ranks; the host tier against FSDP2's
# CPU offload (issue 50, never measured on a GPU); offload, measured once already.
PRIORITY = "adfbcighj" + "e"
SMOKE_SECONDS = 45  # each part's share of a smoke run's plan (tiny shapes on the CPU; it may use what is left)
STARTUP = 15  # seconds the call spends before its first part (imports, the device's context)


def plan_parts(
    letters: list[str], budget: float, earlier: dict[str, dict], limits: dict[str, float], smoke: bool = False
) -> tuple[list[tuple[str, float]], list[str], list[str]]:
    """The parts to run within ``budget`` seconds, most valuable first, with each one's limit;
    the parts left for a later call; those an earlier call finished (``earlier``: its report's
    parts). A part that ran past its limit before is planned again with twice that limit."""
    done = [x for x in PRIORITY if x in letters and earlier.get(x, {}).get("status") in ("ok", "error")]
    left_time = budget - STARTUP
    plan, left = [], []
    for letter in PRIORITY:
        if letter not in letters or letter in done:
            continue
        own = SMOKE_SECONDS if smoke else PARTS[letter][2]
        if earlier.get(letter, {}).get("status") == "timeout":
            own = 2 * max(own, earlier[letter].get("limit", own))
        limit = limits.get(letter, own)
        if limit <= left_time:
            plan.append((letter, limit))
            left_time -= limit
        else:
            left.append(letter)
    return plan, left, done


def plan_text(plan: list[tuple[str, float]], left: list[str], done: list[str], budget: float, where: str) -> str:
    rows = ", ".join(f"{x} ({PARTS[x][0]}, {limit:.0f} s)" for x, limit in plan) or "none"
    text = f"plan for {where} in {budget:.0f} s: {rows}; total {sum(t for _, t in plan) + STARTUP:.0f} s"
    if done:
        text += f"; done by an earlier call: {','.join(done)}"
    if left:
        text += f"; left for the next call with the same --out: {','.join(left)}"
    return text


REPO = Path(__file__).resolve().parents[2]


class PartTimeoutError(Exception):
    """A part ran past its time limit (``--part-timeout``)."""


def _alarm(signum, frame):
    raise PartTimeoutError("the part ran past its time limit and was stopped")


def run_part(letter: str, env: Env, limit: float) -> dict:
    module, title, _ = PARTS[letter]
    env.log(f"part {letter}: {title}")
    record = {"name": module, "title": title, "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        result = importlib.import_module(f"benchmarks.gpu.{module}").run(env)
        record.update(status="ok", traceback=None, **result)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        status = "timeout" if isinstance(e, PartTimeoutError) else "error"
        record.update(status=status, traceback=traceback.format_exc(), figures={}, goals=[], markdown=[])
        env.log(f"part {letter} {status}: {e!r}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        env.free()
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["limit"] = limit
    record["passed"] = record["status"] == "ok" and all(g["passed"] for g in record["goals"])
    return record


def render(report: dict) -> str:
    """The markdown of a report: a summary of the parts, then each part's tables and goals."""
    lines = [
        f"# GPU validation: {report['device_name']}",
        "",
        f"torch {report['torch']}, transformers {report['transformers']}, memfit at commit "
        f"{report.get('commit') or 'unknown'}. "
        f"Commands: {'; '.join(f'`{c}`' for c in report['commands'])}.",
        "",
        *(
            [
                "**Smoke run**: tiny shapes on the CPU, one step each; it checks the script, the figures mean nothing.",
                "",
            ]
            if report.get("smoke")
            else []
        ),
        "| part | what | status | goals met | seconds |",
        "|---|---|---|---|---:|",
    ]
    parts = report["parts"]
    for letter in sorted(parts):
        p = parts[letter]
        met = sum(g["passed"] for g in p["goals"])
        lines.append(f"| {letter} | {p['title']} | {p['status']} | {met}/{len(p['goals'])} | {p['seconds']} |")
    for letter in sorted(parts):
        p = parts[letter]
        lines += ["", f"## {letter}. {p['title']}", ""]
        lines += p["markdown"]
        if p["goals"]:
            lines += ["", "| goal | measured | target | met |", "|---|---:|---|---|"]
            lines += [f"| {g['name']} | {fmt(g['value'])} | {g['target']} | {fmt(g['passed'])} |" for g in p["goals"]]
        if p["traceback"]:
            lines += ["", f"**{p['status']}:**", "", "```", p["traceback"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write(report: dict, stem: Path) -> None:
    """The JSON and the markdown, each written whole to a temporary name, then renamed."""
    for suffix, text in ((".json", json.dumps(report, indent=1, default=str)), (".md", render(report))):
        tmp = stem.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, stem.with_suffix(suffix))


def merge(paths: list[str], out: Path) -> int:
    """One report of the parts of several (the calls of one validation), in ``out``."""
    reports = [json.loads(Path(x).read_text()) for x in paths]
    if len({(r["device"], r["smoke"]) for r in reports}) != 1:
        raise SystemExit(
            "--merge: the reports come from different devices (or smoke and real runs); merge one device's"
        )
    merged = {**reports[-1], "commands": [c for r in reports for c in r["commands"]], "parts": {}}
    for r in reports:
        merged["parts"].update(r["parts"])
    out.mkdir(parents=True, exist_ok=True)
    write(merged, out / f"gpu_{merged['device']}")
    print(f"merged parts {','.join(sorted(merged['parts']))} into {out / ('gpu_' + merged['device'])}.json/.md")
    return 0


def part_limits(text: str) -> dict[str, float]:
    """``--part-timeout``'s seconds per part letter: ``"120"`` sets every part, ``"a=150,b=200"``
    the parts named (the others keep their own)."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(PARTS, float(text))
    limits = {}
    for item in text.split(","):
        letter, _, seconds = item.partition("=")
        if letter.strip() not in PARTS:
            raise ValueError(f"unknown part {letter.strip()!r}; choose from {','.join(PARTS)}")
        limits[letter.strip()] = float(seconds)
    return limits


def summary(report: dict, left: list[str]) -> str:
    """One screen: a line per part (status, goals met, seconds, the first goals missed)."""
    lines = [f"GPU validation on {report['device_name']} (torch {report['torch']}):"]
    for letter in PRIORITY:
        p = report["parts"].get(letter)
        if p is None:
            state = "left for the next call" if letter in left else "not asked for"
            lines.append(f"  {letter} {PARTS[letter][0]:<12} {state}")
            continue
        missed = [g["name"] for g in p["goals"] if not g["passed"]]
        met = len(p["goals"]) - len(missed)
        text = f"  {letter} {p['name']:<12} {p['status']:<7} goals {met}/{len(p['goals'])} {p['seconds']:>6.0f} s"
        if missed:
            text += "  missed: " + "; ".join(missed[:3]) + (f" (+{len(missed) - 3})" if len(missed) > 3 else "")
        lines.append(text[:160])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory for gpu_<device>.json/.md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not the GPU")
    p.add_argument("--parts", default=PRIORITY, help=f"part letters, from {','.join(PRIORITY)} (default: all)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds this call may take: the parts are planned to fit, most valuable first; a second call "
        "with the same --out runs what the first left (default 540)",
    )
    p.add_argument(
        "--part-timeout",
        default="",
        help="seconds per part: one number for all, or letter=seconds pairs (a=150,b=200); default: each part's own",
    )
    p.add_argument(
        "--merge", nargs="+", metavar="JSON", help="no run: merge these reports' parts (later wins) into --out"
    )
    p.add_argument(
        "--bert-batch", type=int, default=0, help="BERT-large's batch in parts b and d (default 16; b halves it on OOM)"
    )
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out))
    letters = [x.strip() for x in args.parts.replace(",", "") if x.strip()]
    if bad := [x for x in letters if x not in PARTS]:
        p.error(f"unknown parts {bad}; choose from {','.join(PRIORITY)}")
    try:
        limits = part_limits(args.part_timeout)
    except ValueError as e:
        p.error(f"--part-timeout {args.part_timeout!r}: {e}")
    out = Path(args.out).resolve()
    if args.smoke and out == (REPO / "benchmarks" / "results").resolve():
        p.error("--smoke never writes into benchmarks/results (the committed GPU results); give another --out")
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        p.error("no CUDA device here: run with --smoke on a CPU (it checks the script, not the GPU)")
    out.mkdir(parents=True, exist_ok=True)
    name = device_name(device)
    stem = out / f"gpu_{name}"
    import transformers

    report = {
        "device": name,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": _commit(),
        "smoke": args.smoke,
        "commands": [],
        "parts": {},
    }
    if stem.with_suffix(".json").exists():  # an earlier call on this device: keep its parts
        earlier = json.loads(stem.with_suffix(".json").read_text())
        if earlier.get("smoke") == args.smoke and earlier.get("device") == name:
            report["parts"] = earlier.get("parts", {})
            report["commands"] = earlier.get("commands", [])
    report["commands"].append(
        "PYTHONPATH=. python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    # the plan for an H200 (what the device's call runs), printed before anything starts
    h200, h200_left, done = plan_parts(letters, args.time_budget, report["parts"], limits)
    print(plan_text(h200, h200_left, done, args.time_budget, "an H200"), flush=True)
    plan, left = h200, h200_left
    if args.smoke:
        plan, left, _ = plan_parts(letters, args.time_budget, report["parts"], limits, smoke=True)
        print(plan_text(plan, left, done, args.time_budget, "this smoke run (CPU)"), flush=True)
    report["plan"] = {"parts": [x for x, _ in plan], "left": left, "budget_s": args.time_budget}
    env = Env(device=device, smoke=args.smoke, out=out, repo=REPO, bert_batch=args.bert_batch)
    order = "".join(x for x, _ in plan)
    env.log(f"device {report['device_name']}, torch {torch.__version__}, parts {order} -> {stem}.*")
    write(report, stem)
    t0 = time.perf_counter()
    for letter, limit in plan:
        remaining = args.time_budget - STARTUP - (time.perf_counter() - t0)
        if remaining < min(limit, 20):  # the parts before took longer than planned: leave it
            left.append(letter)
            env.log(f"part {letter}: {remaining:.0f} s left of the budget; left for the next call")
            continue
        # a smoke part may use what is left (a loaded CPU's times vary); a device part its own limit
        report["parts"][letter] = run_part(letter, env, remaining if args.smoke else min(limit, remaining))
        write(report, stem)  # after every part: a call cut short keeps what it finished
    report["plan"]["left"] = left
    write(report, stem)
    env.log(f"wrote {stem}.json and {stem}.md")
    print(summary(report, left))
    ran = [x for x, _ in plan if x in report["parts"] and x not in left]
    return 0 if all(report["parts"][x]["status"] == "ok" for x in ran) else 1


def _commit() -> str | None:
    """The commit of this tree (``+dirty`` with uncommitted changes), or None outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    sys.exit(main())
