"""memfit train: resumes exactly, and survives a killed rank under torchrun."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import memfit

TINY = ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "4", "--steps", "6", "--lr", "1e-3"]


def memfit_train(
    *args, torchrun=0, fail_at_step=None, fail_in_save=None, restarts=3, check=True, env_path=None, preset=True
):
    # Up to 3 restarts, and a 20 s process-group timeout so that a restarted group that stalls
    # fails and is restarted rather than waiting. With fail_at_step, the last rank is killed at
    # the start of the step after that many steps, on the first attempt (tests/distributed/_train_with_fault.py).
    entry = ["-m", "memfit", "train"]
    if fail_at_step is not None or fail_in_save is not None:
        fault = ["--fail-at-step", str(fail_at_step)] if fail_at_step is not None else []
        fault += ["--fail-in-save", str(fail_in_save)] if fail_in_save is not None else []
        entry = [str(Path(__file__).with_name("_train_with_fault.py")), *fault]
    if torchrun:
        exe = str(Path(sys.executable).parent / "torchrun")
        cmd = [exe, "--standalone", f"--nproc-per-node={torchrun}", f"--max-restarts={restarts}", *entry]
    else:
        cmd = [sys.executable, *entry]
    # The children import the memfit under test (this checkout's), whatever the working directory.
    path = os.pathsep.join(
        filter(None, [str(Path(memfit.__file__).parents[1]), env_path, os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "MEMFIT_PG_TIMEOUT": "20", "PYTHONPATH": path}  # a stuck restarted group fails fast
    shape = TINY if preset else TINY[4:]  # --layers/--hidden resize presets only
    if "--auto" in args:  # it chooses the batch
        i = shape.index("--batch")
        shape = shape[:i] + shape[i + 2 :]
    proc = subprocess.run([*cmd, *shape, *args], check=False, capture_output=True, text=True, timeout=400, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read(path):
    return json.loads(Path(path).read_text())


def test_resume_continues_exactly(tmp_path):
    memfit_train("--json", str(tmp_path / "whole.json"))
    killed = memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2", fail_at_step=4, check=False)
    assert killed.returncode == -signal.SIGKILL  # at the start of step 5, after the step-4 checkpoint
    memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--json", str(tmp_path / "rest.json"))
    whole, rest = read(tmp_path / "whole.json"), read(tmp_path / "rest.json")
    assert [e["step"] for e in rest["log"]] == [5, 6]
    assert [e["loss"] for e in rest["log"]] == [e["loss"] for e in whole["log"][4:]]
    assert rest["params_sha256"] == whole["params_sha256"]
    # the peak logged is that of a step with AdamW state: the same fresh (step 2) and resumed (step 5)
    assert whole["log"][1]["peak_bytes"] == rest["log"][0]["peak_bytes"]


def test_async_saves_resume_exactly_from_the_newest_whole_checkpoint(tmp_path):
    memfit_train("--json", str(tmp_path / "whole.json"))
    ck = str(tmp_path / "ck")
    # SIGKILLed at the start of step 5: the step-4 save, written in the background, may be
    # whole or not; --resume auto continues from the newest whole one (step 4 or step 2).
    killed = memfit_train("--checkpoint-dir", ck, "--save-every", "2", "--async-save", fail_at_step=4, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert "in the background" in killed.stdout + killed.stderr
    resumed = memfit_train(
        "--checkpoint-dir", ck, "--resume", "auto", "--async-save", "--json", str(tmp_path / "rest.json")
    )  # fmt: skip
    whole, rest = read(tmp_path / "whole.json"), read(tmp_path / "rest.json")
    first = rest["log"][0]["step"]
    assert first in (3, 5), (first, os.listdir(ck))
    assert [e["loss"] for e in rest["log"]] == [e["loss"] for e in whole["log"][first - 1 :]]
    assert rest["params_sha256"] == whole["params_sha256"]
    left = sorted(os.listdir(ck))
    assert left[-1] == "step-00000006" and not [n for n in left if ".tmp-" in n], (left, killed.stdout, resumed.stdout)


def test_elastic_restarts_keep_the_global_batch_and_the_loss_curve(tmp_path):
    # 2 ranks, killed after the step-2 checkpoint; restarted with the same flags on 1 rank, killed
    # after step 4; then on 3 (torchrun with another --nproc-per-node): the global batch of 6
    # sequences stays (accumulation 3, 6, 2), so every step trains on the same rows as the
    # uninterrupted run's (See [Note: Elastic restarts] in memfit/cli/_train.py).
    llama = ["--model", "llama", "--batch", "1"]
    memfit_train(*llama, "--global-batch", "6", "--json", str(tmp_path / "whole.json"), torchrun=2)
    flags = [*llama, "--accumulate", "3", "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    metrics = [str(tmp_path / f"part{i}.jsonl") for i in range(3)]
    first = memfit_train(*flags, "--metrics", metrics[0], torchrun=2, fail_at_step=2, restarts=0, check=False)
    assert first.returncode != 0, first.stdout[-2000:]
    second = memfit_train(*flags, "--resume", "--metrics", metrics[1], fail_at_step=4, check=False)
    assert second.returncode == -signal.SIGKILL, second.stdout[-2000:] + second.stderr[-2000:]
    assert (
        "world size 1 (the checkpoint's run had 2): accumulating 6 micro-batches of 1 per rank (was 3)" in second.stdout
    )
    third = memfit_train(*flags, "--resume", "--metrics", metrics[2], torchrun=3)
    assert (
        "world size 3 (the checkpoint's run had 1): accumulating 2 micro-batches of 1 per rank (was 3)" in third.stdout
    )
    parts = [json.loads(line) for m in metrics for line in Path(m).read_text().splitlines()]
    assert [(e["step"], e["world_size"], e["global_batch"]) for e in parts] == [
        (1, 2, 6), (2, 2, 6), (3, 1, 6), (4, 1, 6), (5, 3, 6), (6, 3, 6)
    ]  # fmt: skip
    whole = [e["loss"] for e in read(tmp_path / "whole.json")["log"]]
    assert [e["loss"] for e in parts[:2]] == whole[:2]  # the same world size and accumulation: bitwise
    # Elsewhere the same rows and the same mean gradient, summed in another order: the loss curve
    # continues to rounding (float32 sums of 6 rows' gradients, then AdamW; 1e-4 relative is ~1000 ulps).
    for got, want in zip(parts[2:], whole[2:]):
        assert abs(got["loss"] - want) <= 1e-4 * abs(want), (got["step"], got["loss"], want)


def test_torchrun_restarts_after_a_killed_rank(tmp_path):
    memfit_train("--json", str(tmp_path / "whole.json"), torchrun=2)
    # The restarted ranks meet in the agent's store, which still holds the dead attempt's keys
    # (see [Note: A fresh store for each torchrun attempt]).
    proc = memfit_train(
        "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2", "--resume", "auto",
        "--json", str(tmp_path / "restarted.json"), torchrun=2, fail_at_step=3, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    whole, restarted = read(tmp_path / "whole.json"), read(tmp_path / "restarted.json")
    assert whole["world_size"] == restarted["world_size"] == 2
    assert [e["step"] for e in restarted["log"]] == [3, 4, 5, 6]  # resumed from the step-2 checkpoint
    assert restarted["params_sha256"] == whole["params_sha256"]


def test_errors(tmp_path):
    proc = memfit_train("--checkpoint-dir", str(tmp_path / "none"), "--resume", "yes", check=False)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    memfit_train("--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "6")
    proc = memfit_train("--model", "gpt2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "yes", check=False)
    assert proc.returncode == 2 and "cannot resume from" in proc.stderr and "missing keys" in proc.stderr
    proc = memfit_train("--model", "t5", check=False)
    assert proc.returncode == 2 and "unknown model 't5'" in proc.stderr


def test_accumulate_more_micro_batches_than_batch_rows(tmp_path):
    # --batch is the micro-batch per rank: 2 rows x 4 micro-batches = 8 rows a step
    memfit_train("--batch", "2", "--accumulate", "4", "--steps", "2", "--json", str(tmp_path / "acc.json"))
    assert [e["step"] for e in read(tmp_path / "acc.json")["log"]] == [1, 2]


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    killed = memfit_train(
        "--checkpoint-dir", str(ck), "--save-every", "2", torchrun=2, fail_in_save=2, restarts=0, check=False
    )  # fmt: skip
    assert killed.returncode != 0 and "saved checkpoint step 2" in killed.stdout, killed.stderr[-3000:]
    assert "saved checkpoint step 4" not in killed.stdout
    names = sorted(os.listdir(ck))
    partial = [n for n in names if n.startswith("step-00000004.tmp-")]
    # Rank 1 died after writing its shards; rank 0, failing in the save's next collective, removes
    # the partial save unless torchrun stopped it first: either way no step-4 checkpoint
    assert names[0] == "step-00000002" and len(partial) <= 1 and len(names) == 1 + len(partial), names
    for name in partial:
        assert not (ck / name / "memfit.json").exists()
    # The previous checkpoint is whole (checksums verified), and resuming picks it, at any world size
    resumed = memfit_train(
        "--checkpoint-dir", str(ck), "--save-every", "2", "--resume", "auto", "--json", str(tmp_path / "r.json")
    )  # fmt: skip
    assert f"resumed from step 2 ({ck / 'step-00000002'})" in resumed.stdout
    assert [e["step"] for e in read(tmp_path / "r.json")["log"]] == [3, 4, 5, 6]
    assert sorted(os.listdir(ck)) == ["step-00000002", "step-00000004", "step-00000006"]  # partial removed
    finished = memfit_train("--checkpoint-dir", str(ck), "--resume", "auto")
    assert "the run is finished: the checkpoint is at step 6 of --steps 6" in finished.stdout


def _forecast(proc) -> str:
    found = re.search(r"planned for 1GB per rank: .*?forecast peak ([0-9.]+ [KMG]iB)", proc.stdout)
    assert found, proc.stdout[-2000:]
    return found.group(1)


def test_a_budget_plan_after_an_elastic_restart_holds_the_accumulation_it_runs(tmp_path):
    # 2 ranks at accumulation 1 save at step 2; resumed on 1 rank the run accumulates 2
    # micro-batches to keep the global batch, and its --budget plan must hold their gradients:
    # it was made for the flags' accumulation 1 (See [Note: Elastic restarts]). At --batch 2 the
    # peak is where the accumulated gradients add (at 1, the optimizer step's: the same for both).
    flags = ["--model", "llama", "--batch", "2", "--budget", "1GB", "--steps", "2"]
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    memfit_train(*flags, *ck, torchrun=2)
    resumed = memfit_train(*flags[:-1], "3", *ck, "--resume")
    assert "accumulating 2 micro-batches of 2 per rank (was 1)" in resumed.stdout, resumed.stdout[-2000:]
    two = memfit_train(*flags, "--accumulate", "2")
    one = memfit_train(*flags)
    assert _forecast(resumed) == _forecast(two) != _forecast(one)


def test_auto_after_an_elastic_restart_searches_at_the_checkpoints_global_batch(tmp_path):
    # 2 ranks: --auto picks micro-batch m x accumulation a (global batch 2 m a); resumed on 1
    # rank, it searches at that global batch (m' a' = 2 m a) instead of picking freely and then
    # seeing its accumulation changed after the search (See [Note: Elastic restarts]).
    auto = re.compile(r"--auto for \S+ per rank: micro-batch (\d+) x accumulation (\d+)")
    flags = ["--model", "llama", "--auto", "--budget", "1GB", "--steps", "2"]
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    first = memfit_train(*flags, *ck, torchrun=2)
    m, a = map(int, auto.search(first.stdout).groups())
    resumed = memfit_train(*flags[:-1], "3", *ck, "--resume")
    m1, a1 = map(int, auto.search(resumed.stdout).groups())
    assert m1 * a1 == 2 * m * a, resumed.stdout[-2000:]
    assert "accumulating" not in resumed.stdout, resumed.stdout[-2000:]  # nothing changed after the search


def test_runs_with_accumulation_stay_within_their_budget_forecast():
    # 2 ranks, accumulation 4, sharded: the --budget plan holds 1/2 of the gradients between
    # micro-batches; under no_sync the run held them whole (51.3 MiB against a 47.33 MiB
    # forecast). See [Note: Reducing accumulated gradients]. Replicated (--hybrid-shards 1):
    # every gradient between micro-batches, the backward adding into them, no copy beside them
    # (the forecast counted a DDP-style copy and some gradients twice: 63.17 MiB against 55.3).
    flags = ["--model", "llama", "--budget", "1GB", "--accumulate", "4", "--steps", "2"]
    # Under bf16 (gradients summed in fp32) replicated too: fp32 accumulators under no_sync.
    for layout in ([], ["--hybrid-shards", "1"], ["--hybrid-shards", "1", "--mixed-precision", "bf16"]):
        run = memfit_train(*flags, *layout, torchrun=2)
        forecast = float(re.search(r"forecast peak ([\d.]+) MiB", run.stdout).group(1))
        peak = float(re.search(r"peak [\d.]+-([\d.]+) MiB per rank", run.stdout).group(1))  # the highest rank's
        assert peak <= forecast + 0.05, (layout, run.stdout[-2000:])  # the log rounds to 0.1 MiB
        assert forecast <= 1.02 * peak, (layout, run.stdout[-2000:])  # not a loose bound


def test_trials_on_two_ranks_train_the_fastest_they_expect(tmp_path):
    # --trials 3: both ranks build and time the 3 fastest-predicted configurations together (each
    # step's time the slower rank's), agree on the fastest expected (measured weighed against the
    # scaled price), and train it (See [Note: Trying configurations]).
    flags = ["--model", "llama", "--auto", "--budget", "1GB", "--global-batch", "8", "--steps", "2", "--trials", "3"]
    run = memfit_train(*flags, "--json", str(tmp_path / "run.json"), torchrun=2)
    start = next(line for line in run.stdout.splitlines() if "--auto for 1GB" in line)
    said = start.split("; tried ")[1]
    tried = re.findall(r"(\d+) x (\d+) ([^:,]+(?:, no reshard)?): ([\d.]+) ms \(expected ([\d.]+) ms\)", said)
    weighed = r"trial scale [\d.]+ \(the median measured / predicted\), measured-time weight [\d.]+;"
    assert len(tried) == 3 and re.search(weighed, said), start
    m, a, layout, *_ = min(tried, key=lambda t: float(t[4]))  # one global batch: the least time, the most tokens/s
    assert f"micro-batch {m} x accumulation {a}, {layout}," in start, start
    assert [e["step"] for e in read(tmp_path / "run.json")["log"]] == [1, 2]
