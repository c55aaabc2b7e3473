"""``python -m benchmarks.gpu --out DIR [--smoke] [--parts a,b,...]``: see benchmarks/gpu/__init__.py."""

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

# letter -> (module, title, seconds it may take on one H100 before it is stopped)
PARTS = {
    "a": ("correctness", "Correctness on the device", 300),
    "b": ("bert", "The seed's experiment: BERT-large MLM, seq 512", 330),
    "c": ("sharding", "Sharding at W=1 on NCCL: plain vs FSDP2 vs memfit", 270),
    "d": ("planner", "Planner and meter against the allocator", 200),
    "e": ("offload", "Offload: pinned copies, offload='cpu' vs save_on_cpu", 120),
    "f": ("train", "memfit train --device cuda, resumed once", 150),
    "g": ("autoconfig", "autoconfigure's top configurations tried on the device", 150),
}
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
    record["passed"] = record["status"] == "ok" and all(g["passed"] for g in record["goals"])
    return record


def render(report: dict) -> str:
    """The markdown of a report: a summary of the parts, then each part's tables and goals."""
    lines = [
        f"# GPU validation: {report['device_name']}",
        "",
        f"torch {report['torch']}, transformers {report['transformers']}, memfit from this tree. "
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    p.add_argument("--out", required=True, help="directory for gpu_<device>.json and gpu_<device>.md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not the GPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)} (default: all)")
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
    letters = [x.strip() for x in args.parts.split(",") if x.strip()]
    if bad := [x for x in letters if x not in PARTS]:
        p.error(f"unknown parts {bad}; choose from {','.join(PARTS)}")
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
    env = Env(device=device, smoke=args.smoke, out=out, repo=REPO, bert_batch=args.bert_batch)
    env.log(f"device {report['device_name']}, torch {torch.__version__}, parts {','.join(letters)} -> {stem}.*")
    write(report, stem)
    for letter in letters:
        limit = limits.get(letter, PARTS[letter][2])
        report["parts"][letter] = run_part(letter, env, limit)
        write(report, stem)
    summary = ", ".join(
        f"{k}: {v['status']}{'' if v['passed'] else ' (goals missed)'}" for k, v in report["parts"].items()
    )
    env.log(f"done: {summary}; wrote {stem}.json and {stem}.md")
    print(render(report))
    return 0 if all(report["parts"][x]["status"] == "ok" for x in letters) else 1


if __name__ == "__main__":
    sys.exit(main())
