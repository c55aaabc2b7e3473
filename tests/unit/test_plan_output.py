"""`Plan.table()` reads as a decision: the peak's parts add up to the peak at the moment that
sets it (the other moments' terms named apart), the columns have a legend, a decimal budget
shows its binary size, and the levers are ranked by step time per GiB off the peak."""

import dataclasses
import itertools
import json
import re

import pytest
import torch

import memfit
from memfit._plan._budget import describe_bytes, format_bytes
from memfit._plan._profile import DECISIONS
from memfit._plan._solve import Sharding, forecast, timeline
from memfit.cli import main
from memfit.cli._output import categorized
from tests.unit.test_planner import synthetic

LAYOUTS = [None, Sharding(4), Sharding(8, shard_size=4)]


def _parts(f: dict) -> dict:
    return {k.removeprefix("part:"): v for k, v in f.items() if k.startswith("part:")}


@pytest.mark.parametrize("layout", LAYOUTS, ids=["one process", "W=4", "W=8 HSDP 4"])
def test_the_parts_of_every_moment_add_up_to_the_peak(layout):
    base = synthetic(3)
    # A large optimizer step, a long embeddings' backward, a large head: each sets the peak somewhere.
    profiles = [
        base,
        dataclasses.replace(base, optimizer_peak=10**6),
        dataclasses.replace(base, tail_transient=10**6),
        dataclasses.replace(base, head_transient=10**6),
    ]
    moments = set()
    for profile, ds in itertools.product(profiles, itertools.product(DECISIONS, repeat=3)):
        f = forecast(profile, list(ds), layout)
        assert sum(_parts(f).values()) == pytest.approx(f["peak"], rel=1e-12, abs=1e-6), (f["at"], ds)
        moments.add("backward" if f["at"].startswith("backward of ") else f["at"])
    assert {"end of forward", "backward", "optimizer step", "backward before the blocks"} <= moments


def _table_sum(text: str) -> tuple[list[str], str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("the peak") and "is the sum of:" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("= peak"))
    return lines[start + 1 : end], lines[end]


LAYOUTS_PLOTTED = [*LAYOUTS, Sharding(4, reshard_after_forward=False)]


@pytest.mark.parametrize("layout", LAYOUTS_PLOTTED, ids=["one process", "W=4", "W=8 HSDP 4", "W=4 no reshard"])
def test_the_timeline_walks_the_step_and_peaks_where_the_forecast_does(layout):
    base = synthetic(3)
    profiles = [base, dataclasses.replace(base, optimizer_peak=10**6), dataclasses.replace(base, head_transient=10**6)]
    for profile, ds in itertools.product(profiles, itertools.product(DECISIONS, repeat=3)):
        f = forecast(profile, list(ds), layout)
        steps = timeline(profile, list(ds), layout)
        names = [e["moment"] for e in steps]
        blocks = [b.path for b in profile.blocks]
        assert names[:4] == [f"forward of {p}" for p in blocks] + ["end of forward"]  # no F_i here
        assert names[4:7] == [f"backward of {p}" for p in reversed(blocks)] and names[-1] == "optimizer step"
        top = max(steps, key=lambda e: e["total"])
        assert (top["moment"], top["total"]) == (f["at"], pytest.approx(f["peak"], rel=1e-12)), ds
        for e in steps:  # every part is drawn in a category, and the categories add up
            assert sum(categorized(e["parts"]).values()) == pytest.approx(e["total"], rel=1e-12)


def test_plan_plot_writes_a_png_and_the_timeline_in_the_json(tmp_path, capsys):
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    flags = ["--model", "gpt2", "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2", "--budget", "1GB"]
    main(["plan", *flags, "--plot", str(png), "--json", str(js)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(js.read_text())
    assert max(e["total"] for e in saved["timeline"]) == pytest.approx(saved["predicted_peak"], rel=1e-12)
    assert f"wrote the plot {png} (its numbers: 'timeline' in {js})" in capsys.readouterr().out
    assert main(["plan", *flags, "--plot", "plan.pdf"]) != 0
    assert "error: memfit plan: --plot 'plan.pdf': name a .png file" in capsys.readouterr().err


@pytest.mark.parametrize("layout", LAYOUTS, ids=["one process", "W=4", "W=8 HSDP 4"])
def test_the_table_shows_the_sum_the_legend_and_the_other_terms(layout):
    profile = synthetic(4)
    keep = forecast(profile, ["keep"] * 4, layout)["peak"]
    plan = memfit.plan(
        torch.nn.Linear(2, 2),
        {},
        budget=int(keep * 0.9),
        profile=profile,
        world_size=layout.world_size if layout else 1,
        shard_size=layout.shard_size if layout else None,
    )
    text = plan.table()
    parts, total = _table_sum(text)
    assert [line.split()[0] for line in parts] == [k for k, v in _parts(plan.forecast).items() if v]
    assert total.split()[-2:] == format_bytes(plan.predicted_peak).split()
    assert f"{format_bytes(plan.predicted_peak)} at {plan.forecast['at']}, is the sum of:" in text
    assert any(line.startswith("kept: ") and "saved: " in line and "extra ms: " in line for line in text.splitlines())
    others = next(line for line in text.splitlines() if line.startswith("other moments' terms (not in the sum):"))
    assert "optimizer_peak" in others or "optimizer_peak" in [p.split()[0] for p in parts]


def test_levers_are_ranked_by_time_per_gib_and_price_the_peak():
    profile = synthetic(4)
    plan = memfit.plan(torch.nn.Linear(2, 2), {}, budget="1GB", profile=profile, world_size=4)
    lines = plan.table().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("levers that lower the peak, cheapest first"))
    levers = [line for line in lines[start + 1 :] if line.endswith("ms/GiB")]
    costs = [float(line.split("=")[-1].split()[0]) for line in levers]
    assert len(levers) >= 3 and costs == sorted(costs)
    names = [re.split(r"\s{2,}", line.strip())[0] for line in levers]
    assert "model state offload (memfit.shard(offload='cpu'))" in names and "full on every block" in names
    keep = forecast(profile, ["keep"] * 4, Sharding(4))["peak"]
    full = forecast(profile, ["full"] * 4, Sharding(4))
    row = next(line for line in levers if line.strip().startswith("full on every block"))
    assert f"saves {format_bytes(keep - full['peak'])} for {full['extra_time'] * 1e3:.1f} ms" in " ".join(row.split())


def test_a_decimal_budget_is_shown_with_its_binary_size():
    assert describe_bytes(memfit.parse_bytes("80GB")) == "80 GB = 74.51 GiB"
    assert describe_bytes(memfit.parse_bytes("800MB")) == "800 MB = 762.94 MiB"
    assert describe_bytes(memfit.parse_bytes("1.5TB")) == "1.5 TB = 1396.98 GiB"
    assert describe_bytes(memfit.parse_bytes("3.5GiB")) == "3.50 GiB"  # binary: as written
    assert describe_bytes(12345) == "12.06 KiB"
    profile = synthetic(3)
    plan = memfit.plan(torch.nn.Linear(2, 2), {}, budget="30KB", profile=profile)
    assert "budget 30 KB = 29.30 KiB in one process:" in plan.table()


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8, 1.0])
def test_the_run_handed_to_train_is_the_cheapest_uniform_kind_that_fits(tmp_path, fraction):
    # See [Note: From a plan to a run]: memfit train takes one --checkpointing kind for all blocks.
    from memfit.cli._plan import PlanConfig, run_lines

    profile = synthetic(4)
    peaks = {k: forecast(profile, [k] * 4) for k in ("keep", "selective", "full")}
    budget = int(peaks["full"]["peak"] + fraction * (peaks["keep"]["peak"] - peaks["full"]["peak"]))
    plan = memfit.plan(torch.nn.Linear(2, 2), {}, budget=budget, profile=profile)
    fitting = {k: f["extra_time"] for k, f in peaks.items() if f["peak"] <= budget}
    want = min(fitting, key=fitting.__getitem__)
    emit = tmp_path / "run.toml"
    lines = run_lines(PlanConfig(model="gpt2", budget=str(budget), emit=str(emit)), plan, 16, 2)
    assert lines[-1] == f"run it: memfit train --config {emit}"
    assert f"--checkpointing {want} predicts {format_bytes(peaks[want]['peak'])} (fits " in lines[-2]
    assert f'checkpointing = "{want}"' in emit.read_text()


def test_a_plan_train_cannot_run_says_so_and_why(capsys):
    """Offloaded blocks and a chunked head fit where no uniform kind does: the last lines say
    memfit train cannot run the plan, and why, before the closest run."""
    flags = ["--model", "llama", "--layers", "2", "--hidden", "64", "--seq", "256", "--batch", "8"]
    assert main(["plan", *flags, "--budget", "97.7MiB"]) == 0  # the smallest: 97.57 MiB
    out = capsys.readouterr().out
    assert "memfit train cannot run this plan within the budget: it needs offload blocks and a chunked head" in out
