"""The GPU validation script (benchmarks/gpu) on the CPU: `--smoke` runs every part end to end
with tiny shapes and each reports; a part that fails shows its traceback here. It checks the
script's code paths, not the GPU (docs/gpu-validation.md)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memfit

REPO = Path(memfit.__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.gpu from this checkout, before any installed `benchmarks`

from benchmarks.gpu import __main__ as gpu  # noqa: E402
from benchmarks.gpu._env import Env  # noqa: E402

# The parts `make test` runs in smoke mode (the slow tier runs them all, ~200 s on 2 loaded
# cores): the cheapest that cover each kind of row the device runs, bf16 included (c's BERT
# rows in fp32 and bf16, d's budgets, e's copies and strategies, i's rates, j's host tier),
# about 30 s together on 2 loaded cores; a, b, f, g and h (20-60 s each) run in the slow tier.
FAST_PARTS = "cdeij"


def smoke(tmp_path, parts: str | None = None) -> tuple[dict, str, subprocess.CompletedProcess]:
    """Run ``--smoke --time-budget 540`` (only ``parts`` when given); check what every part
    holds on the CPU: ok, no recorded errors, its section in the markdown."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--time-budget", "540", "--out", str(tmp_path)]
    cmd += ["--parts", ",".join(parts)] if parts else []
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=900, check=False
    )
    assert (tmp_path / "gpu_cpu.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_cpu.json").read_text())
    markdown = (tmp_path / "gpu_cpu.md").read_text()
    assert report["smoke"] and sorted(report["parts"]) == sorted(parts or gpu.PARTS)
    assert "GPU validation on CPU (smoke run)" in proc.stdout  # the one-screen summary
    for letter, part in sorted(report["parts"].items()):
        assert part["status"] == "ok", f"part {letter} ({part['name']}) {part['status']}:\n{part['traceback']}"
        errors = part["figures"].get("errors")
        assert not errors, f"part {letter} ({part['name']}) recorded errors:\n" + "\n".join(
            f"{k}: {v}" for k, v in errors.items()
        )
        assert part["markdown"] and f"## {letter}. {part['title']}" in markdown
    return report, markdown, proc


def test_smoke_runs_every_part(tmp_path):
    t0 = time.perf_counter()
    report, _, proc = smoke(tmp_path)
    seconds = time.perf_counter() - t0
    assert proc.stdout.startswith("plan for an H200 in 540 s: a (correctness"), proc.stdout[:500]  # before any part
    fixtures = {p.name.split("-")[0] for p in (tmp_path / "fixtures").glob("ops_*_cpu.json")}
    assert fixtures == {"ops_b", "ops_c"}, fixtures  # the op streams of parts b and c, per configuration
    for letter in ("b", "c"):  # every row timed before the part's first profile, then profiled
        figures = report["parts"][letter]["figures"]
        assert figures["timed_after_profiler"]["rows"] == [], figures["timed_after_profiler"]
        rows = [r for rows in figures["results"].values() for r in rows.values()]
        assert rows and all("kernels" in r and "skipped" in r["peak_snapshot"] for r in rows), rows
    assert report["parts"]["c"]["figures"]["timed_after_profiler"]["sessions_before_part"] > 0  # b profiled
    # What the CPU can show holds here too: parity, the race probe, syncs, resume.
    for letter in ("a", "f"):
        missed = [g for g in report["parts"][letter]["goals"] if not g["passed"]]
        assert not missed, f"part {letter}: goals missed on the CPU: {missed}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"smoke run: {seconds:.0f}s")


def test_smoke_runs_the_cheap_parts_in_the_fast_tier(tmp_path):
    """`make test`'s share of the smoke run (FAST_PARTS): bf16 rows included, the host tier
    against FSDP2's CPU offload among them."""
    report, _, proc = smoke(tmp_path, FAST_PARTS)
    bert = report["parts"]["c"]["figures"]["results"]
    assert {"bert fp32", "bert bf16"} <= set(bert), sorted(bert)
    rows = report["parts"]["j"]["figures"]["results"]["bert"]
    assert set(rows) == {"torch FSDP2 CPUOffloadPolicy", "memfit host_optimizer"}
    assert rows["memfit host_optimizer"]["unit_steps_in_backward"] > 0  # the host step ran in backward
    assert proc.returncode == 0, proc.stderr[-3000:]


def _env(tmp_path) -> Env:
    import torch

    return Env(device=torch.device("cpu"), smoke=True, out=tmp_path, repo=REPO)


def test_a_failing_part_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    import types

    def boom(env):
        raise ValueError("planted failure")

    def slow(env):
        time.sleep(30)

    for name, fn in (("boom", boom), ("slow", slow)):
        monkeypatch.setitem(sys.modules, f"benchmarks.gpu.{name}", types.SimpleNamespace(run=fn))
    monkeypatch.setitem(gpu.PARTS, "x", ("boom", "A part that raises", 60))
    monkeypatch.setitem(gpu.PARTS, "y", ("slow", "A part past its limit", 60))
    failed = gpu.run_part("x", _env(tmp_path), 60)
    assert failed["status"] == "error" and not failed["passed"]
    assert "ValueError: planted failure" in failed["traceback"]
    stopped = gpu.run_part("y", _env(tmp_path), 0.5)
    assert stopped["status"] == "timeout" and stopped["seconds"] < 10
    report = {
        "device_name": "test",
        "torch": "-",
        "transformers": "-",
        "commands": ["c"],
        "parts": {"x": failed, "y": stopped},
    }
    text = gpu.render(report)
    assert "| x | A part that raises | error | 0/0 |" in text and "planted failure" in text
    assert "| y | A part past its limit | timeout |" in text


def test_smoke_never_writes_into_the_committed_results():
    with pytest.raises(SystemExit):
        gpu.main(["--smoke", "--out", str(REPO / "benchmarks" / "results")])


def test_merge_joins_the_parts_of_two_calls(tmp_path):
    def report(letter: str, value: int) -> dict:
        part = {"name": "p", "title": f"part {letter}", "status": "ok", "traceback": None, "seconds": 1.0}
        part |= {"figures": {"value": value}, "goals": [], "markdown": [f"value {value}"], "passed": True}
        return {
            "device": "h100",
            "device_name": "NVIDIA H100",
            "torch": "2.11",
            "transformers": "5",
            "smoke": False,
            "commands": [f"call {letter}"],
            "parts": {letter: part},
        }

    for i, letter in enumerate("ab"):
        (tmp_path / f"{letter}.json").write_text(json.dumps(report(letter, i)))
    assert (
        gpu.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "out")]) == 0
    )
    merged = json.loads((tmp_path / "out" / "gpu_h100.json").read_text())
    assert sorted(merged["parts"]) == ["a", "b"] and merged["commands"] == ["call a", "call b"]
    text = (tmp_path / "out" / "gpu_h100.md").read_text()
    assert "## a. part a" in text and "value 1" in text


def test_the_plan_fits_the_budget_most_valuable_first_and_a_second_call_completes_it():
    letters = list(gpu.PRIORITY)
    plan, left, done = gpu.plan_parts(letters, 540, {}, {})
    assert sum(limit for _, limit in plan) + gpu.STARTUP <= 540 and done == []
    order = [x for x, _ in plan]
    assert order[0] == "a" and order == [x for x in gpu.PRIORITY if x in order]
    assert all(gpu.PRIORITY.index(x) > gpu.PRIORITY.index(order[-1]) for x in left)
    assert sorted(order + left) == sorted(gpu.PARTS)
    earlier = {x: {"status": "ok"} for x in order}
    earlier[order[-1]] = {"status": "timeout", "limit": plan[-1][1]}  # cut at its limit: again, with twice it
    again, still, done = gpu.plan_parts(letters, 540, earlier, {})
    assert [x for x, _ in again] == [order[-1], *left] and still == [] and done == order[:-1]
    assert dict(again)[order[-1]] == 2 * plan[-1][1]
    assert gpu.plan_parts(letters, 100, {}, {})[0] == [("a", gpu.PARTS["a"][2])]  # a small budget: a alone
