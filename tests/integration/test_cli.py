"""The memfit command: bench and plan end to end on tiny shapes, and their errors."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from memfit._plan import _calibrate
from memfit.cli import main

TINY = ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2"]


def test_bench_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", *TINY, "--repeats", "1", "--warmup", "1", "--compare", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    saved = json.loads(out.read_text())
    rows = saved["results"]
    assert saved["config"]["budget"] == rows[-1]["budget"] > 0  # the budget the planned row used
    assert all(len(r["step_seconds_each"]) == 1 and r["breakdown"]["parameters"] > 0 for r in rows)
    names = [r["strategy"] for r in rows]
    assert names == ["keep", "selective", "full", "offload", "torch.utils.checkpoint", "planned"]
    assert len({round(r["loss"], 6) for r in rows}) == 1  # same model, same batch, same loss
    planned = rows[-1]
    assert planned["peak_bytes"] <= 1.05 * planned["budget"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "peak MiB" in printed and f"wrote {out}" in printed and f"wrote the plot {png}" in printed


def test_plan_prints_table(capsys):
    assert main(["plan", *TINY, "--model", "gpt2", "--budget", "1GB"]) == 0
    text = capsys.readouterr().out
    assert "transformer.h.0" in text and "predicted peak" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--model", "nope"], r"unknown model 'nope'; choose one of \['bert', 'bert-base'"),
        (["bench", "--strategies", "keep", "fast"], r"unknown strategies \['fast'\]; choose from"),
        (["plan", *TINY, "--budget", "1KB"], r"no plan fits 1000 B\. The smallest budget that fits is"),
        (["plan", "--budget", "lots"], r"cannot read the memory budget 'lots'"),
    ],
)
def test_errors_say_what_to_do(argv, message, capsys):
    assert main(argv) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_plan_for_more_ranks_than_cores_is_a_forecast_without_a_warning(capsys, recwarn):
    # `memfit plan --world-size 64` forecasts a cluster from a laptop: no process is started.
    assert main(["plan", *TINY, "--budget", "1GB", "--world-size", "999"]) == 0
    assert not [w for w in recwarn if "CPU cores" in str(w.message)]
    assert "per rank (world size 999)" in capsys.readouterr().out


def test_plan_llama_8b_on_8_gpus_answers_from_shapes(capsys):
    # 8B parameters on the meta device: nothing allocated (see benchmarks/results/planner.md for the time).
    argv = ["plan", "--model", "llama-8b", "--world-size", "8", "--budget", "80GB", "--dtype", "bf16"]
    assert main([*argv, "--device-profile", "h100", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "fits, predicted peak" in out and "smallest budget any plan fits" in out and "what to change" in out
    assert "state" in out and "gather_buffers" in out and "time on h100" in out


def test_bench_world_size_compares_ddp_and_sharding(tmp_path, capsys):
    out = tmp_path / "dist.json"
    argv = ["bench", *TINY, "--world-size", "2", "--repeats", "1", "--warmup", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"DDP", "memfit"}
    assert rows["memfit"]["peak_bytes"] < rows["DDP"]["peak_bytes"]  # parameters, grads, AdamW sharded
    assert rows["memfit"]["loss"] == rows["DDP"]["loss"]  # same init, same batch on rank 0
    assert rows["memfit"]["baseline"] == "DDP" and "peak_vs_baseline" in rows["memfit"]
    assert "overhead vs DDP" in capsys.readouterr().out


def test_progress_lines_when_stdout_is_not_a_terminal(capsys):
    # capsys: stdout is not a terminal, as in CI logs; progress comes as plain lines
    assert main(["plan", *TINY, "--model", "gpt2", "--budget", "1GB"]) == 0
    assert "plan: profiling one batch" in capsys.readouterr().out
    assert main(["bench", *TINY, "--strategies", "keep", "full", "--repeats", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "[1/" in out and "warm-up: keep" in out and "memory: full" in out


def test_bench_world_size_refuses_one_process_flags(capsys):
    assert main(["bench", *TINY, "--world-size", "2", "--strategies", "full"]) == 2
    assert "--strategies and --budget apply to one process" in capsys.readouterr().err
    assert main(["bench", *TINY, "--world-size", "2", "--budget", "300MB"]) == 2
    assert "--strategies and --budget apply to one process" in capsys.readouterr().err


def test_calibrate_caches_the_rates_the_planner_uses_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    # The command and its cache are under test, not the rates: 4 MiB operand pools, not 64
    # (see [Note: Calibrating on cold data]), about 16x less work.
    monkeypatch.setattr(_calibrate, "_cold", functools.partial(_calibrate._cold, pool_bytes=4 * 2**20))
    threads = torch.get_num_threads()
    assert main(["calibrate", "--cpu-time"]) == 0  # one thread, CPU time; then the threads as they were
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    assert (tmp_path / "device-cpu.json").exists() and "memory_bandwidth" in out
    assert f"cached in {tmp_path / 'device-cpu.json'}" in out and "--device-profile calibrated" in out
    from memfit._plan._calibrate import device_profile

    cached = device_profile("calibrated")
    assert cached.name == "calibrated-cpu" and device_profile(None).name == "cpu"  # only when asked for


def test_calibrate_with_ranks_refuses_cpu_time_and_fewer_than_one(capsys):
    for flags, message in (
        (["--world-size", "2", "--cpu-time"], "--cpu-time measures one thread alone"),
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--world-size", "2", "--device", "auto"], "runs on --device cpu (gloo) or cuda"),
    ):
        assert main(["calibrate", *flags]) != 0
        assert message in capsys.readouterr().err


def test_calibrate_with_ranks_caches_their_links(tmp_path):
    # 2 spawned ranks calibrate together (~100 s: each rank's compute, then the links); the
    # cache holds the link figures and each collective's cost that memfit plan --auto prices.
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "memfit", "calibrate", "--world-size", "2"],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "measured by 2 ranks together" in proc.stdout
    cached = json.loads((tmp_path / "device-cpu.json").read_text())
    assert cached["ranks_per_node"] == 2 and cached["intra_node_bandwidth"] > 0
    assert cached["collective_overhead"] >= 0 and cached["name"] == "calibrated-cpu"
