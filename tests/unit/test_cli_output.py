"""What the CLI prints agrees with itself: one figure per quantity, and where two figures differ
by design the line says why (the smallest budget with the head chunked and whole, the keep-
everything peak, --auto's two step times, the command that continues a torchrun job); long
phases show progress."""

import io
import re
import time
from types import SimpleNamespace

import memfit
from memfit.cli._launch import relaunched
from memfit.cli._plan import chosen_plan_table
from memfit.cli._progress import phase
from memfit.models import Shape, gpt2_lm, lm_batch


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_the_keep_everything_peak_and_the_smallest_budget_read_once():
    shape = Shape(layers=2, hidden=32, heads=2, seq=32, batch=4, vocab=4096, dropout=0.0)
    model, batch = gpt2_lm(shape), lm_batch(shape)
    plain = memfit.plan(model, batch, budget="1GB", chunk_head=False)
    text = plain.table()
    keep = _line(text, "smallest budget").split("keeping every activation: ")[1]
    levers = re.search(r"off the keep-everything peak, (.*)\):", text)
    assert levers and levers[1] == keep  # the same quantity, the same figure (both rounded up)
    assert "with them whole" not in text  # no chunked head was allowed: one smallest budget
    # A budget only a chunked head fits: the smallest budget says what it is with the head whole
    both = memfit.plan(model, batch, budget="1GB")
    floor = _line(both.table(), "smallest budget")
    whole = re.search(r"\(with the head and loss chunked; (.*) with them whole\)", floor)
    assert whole, floor
    tight = memfit.plan(model, batch, budget=int(memfit.parse_bytes(whole[1].replace(" ", "")) * 0.97))
    assert tight.head == "chunked"
    text = tight.table()
    assert "keeping every activation: " in text and "(head and loss chunked, as planned)" in text
    assert "off the keep-everything peak with the head and loss whole, " in text


def _auto(step_s: float, said_ms: str):
    layout = SimpleNamespace(describe=lambda: "full shard")
    best = SimpleNamespace(micro_batch=2, accumulation=4, step_time=step_s, layout=layout)
    table = f"budget 1 GB\ntime on cpu (fixed rates): predicted step {said_ms} ms, of which recompute 0.0 ms\nend"
    return SimpleNamespace(best=best, plan=SimpleNamespace(table=lambda: table))


def test_autos_two_step_times_say_why_they_differ():
    line = _line(chosen_plan_table(_auto(0.179, "95.6")), "time on cpu")
    assert line.startswith("time on cpu (fixed rates): predicted step 95.6 ms, of which recompute 0.0 ms; ")
    assert "the plan's own step (micro-batch 2, as memfit.plan prices it), not the configuration's 179.0 ms" in line
    assert "(4 micro-batches, the optimizer and the communication of full shard)" in line
    same = _auto(0.0956, "95.6")
    assert chosen_plan_table(same) == same.plan.table()  # one figure: nothing to explain


def test_the_continue_line_keeps_torchrun():
    line = "memfit train --steps 30 --checkpoint-dir ck --resume auto"
    assert relaunched(line, {}) == line
    one_node = {"TORCHELASTIC_RUN_ID": "r", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    assert relaunched(line, one_node) == f"torchrun --nproc-per-node 2 -m {line}"
    two = {"TORCHELASTIC_RUN_ID": "r", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}
    assert relaunched(line, two) == (
        f"torchrun --nnodes 2 --nproc-per-node 4 -m {line} (with this job's rendezvous flags)"
    )


def test_a_long_phase_reports_while_it_runs(capsys):
    err = io.StringIO()
    with phase("plan", "searching", every=0.01, err=err):
        deadline = time.monotonic() + 30
        while "still at it" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert capsys.readouterr().out == "plan: searching\n"  # the phase's start, with the answer
    lines = err.getvalue().splitlines()
    assert re.fullmatch(r"plan: searching: still at it, \d+ s so far", lines[0]), lines
    assert re.fullmatch(r"plan: searching: done in \d+ s", lines[-1]), lines
    quiet = io.StringIO()
    with phase("plan", "searching", shown=False, every=0.01, err=quiet) as report:
        report("micro-batch 1 (1 of at most 7 sizes): profiling on fake tensors")
        time.sleep(0.05)
    assert capsys.readouterr().out == "" and quiet.getvalue() == ""  # ranks other than 0


def test_a_phase_says_the_step_it_was_told_at_once_and_in_its_ticks(capsys):
    err = io.StringIO()
    with phase("plan", "searching", every=0.01, err=err) as report:
        report("micro-batch 2 (2 of at most 7 sizes): profiling on fake tensors")
        deadline = time.monotonic() + 30
        while "so far (micro-batch" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    # (a tick may come before the step is told: the lines after it say it)
    lines = [line for line in err.getvalue().splitlines() if "micro-batch" in line]
    step = r"micro-batch 2 \(2 of at most 7 sizes\): profiling on fake tensors"
    assert re.fullmatch(rf"plan: {step}, \d+ s in", lines[0]), lines
    assert re.fullmatch(rf"plan: searching: still at it, \d+ s so far \({step}\)", lines[1]), lines
