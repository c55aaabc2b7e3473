"""The plots' rules that do not need a picture: one colour per term across every plot, and the
bench plot's recommended strategy with the strategies its repeats cannot tell apart (See [Note:
One colour per term] in memfit/cli/_output.py). The pictures themselves are looked at, and the
one the docs show is committed (docs/images/)."""

import pytest

from memfit.cli import _output
from memfit.cli._output import BREAKDOWN, CATEGORIES, COLOURS, recommended

MIB = 2**20


def test_every_term_of_every_plot_has_its_own_colour():
    terms = [*CATEGORIES, *BREAKDOWN.values(), "peak (not split)"]
    assert set(terms) <= set(COLOURS), set(terms) - set(COLOURS)
    # the same memory measured (bench) and predicted (plan, --auto) is one colour
    assert COLOURS["activations and other"] == COLOURS["activations"]
    assert COLOURS["parameters"] == COLOURS["parameters and optimizer state"]
    predicted = [COLOURS[c] for c in CATEGORIES]
    assert len(set(predicted)) == len(predicted)  # within a plot, no two terms alike
    measured = [COLOURS[c] for c in BREAKDOWN.values()]
    assert len(set(measured)) == len(measured)


def row(name, peak, times, **extra):
    return {"strategy": name, "peak_bytes": peak * MIB, "step_seconds": sorted(times)[len(times) // 2],
            "step_seconds_each": times, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        # the fastest that fits; keep is faster but over the budget
        (
            [
                row("keep", 300, [0.5, 0.5, 0.5]),
                row("full", 200, [1.0, 1.1, 1.2], budget=250 * MIB),
                row("plan", 240, [0.8, 0.8, 0.9]),
            ],
            (2, []),
        ),
        # min-max ranges overlap: the repeats cannot tell them apart
        (
            [row("keep", 100, [0.8, 1.0, 1.3]), row("ckpt", 90, [0.7, 0.74, 1.1]), row("full", 80, [1.2, 1.2, 1.3])],
            (1, [0]),
        ),
        # one repeat: no spread, nothing can be told apart
        ([row("keep", 100, [1.0]), row("ckpt", 90, [0.7])], (1, [0])),
        # nothing fits
        ([row("keep", 300, [1.0], budget=100 * MIB)], (None, [])),
    ],
)
def test_recommended_is_the_fastest_that_fits_and_names_what_noise_hides(rows, want):
    assert recommended(rows) == want


def test_the_verdict_line_names_the_pick_and_asks_for_repeats():
    rows = [row("keep", 100, [0.8, 1.0, 1.3]), row("ckpt", 90, [0.7, 0.74, 1.1])]
    line = _output._verdict(rows, *recommended(rows))
    assert line.startswith("* recommended: ckpt (fastest median step (no budget given))")
    assert "cannot tell it from keep" in line and "more --repeats" in line


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [row("keep", 100, [0.8, 1.0]), row("ckpt", 90, [0.7, 0.74], budget=120 * MIB, predicted_peak=95 * MIB)]
    _output.plot(rows, str(tmp_path / "b.png"), "a title " * 20)
    parts = {"state": MIB, "gradients": 2 * MIB}
    timeline = [{"moment": f"forward of model.layers.{i}", "total": 3 * MIB, "parts": parts} for i in range(3)]
    _output.plot_timeline(timeline, 4 * MIB, str(tmp_path / "t.png"), "a long title " * 20)
    assert (tmp_path / "b.png").stat().st_size > 1000 and (tmp_path / "t.png").stat().st_size > 1000
