"""What the commands write: tables on the console (rich when installed), JSON, a plot."""

from __future__ import annotations

import contextlib
import json
import os

MIB = 2**20


def write_json(path: str, data: object) -> None:
    """Write ``data`` to ``path`` as indented JSON."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the `cli` extra; imported when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


BREAKDOWN = {  # MemoryMeter's categories at the peak, as the bench plot names them
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations_and_other": "activations and other",
}

# [Note: One colour per term]
# Every plot memfit draws (the bench's measured peaks, the plan's and --auto's timelines) gives a
# term the same colour, whichever terms a plot happens to show: colours are looked up by the
# term's name here, never taken from matplotlib's cycle (which shifts when a term is absent).
# Terms that are the same memory in the measured and the predicted plots share a colour.
COLOURS = {
    "parameters and optimizer state": "tab:blue",
    "parameters": "tab:blue",
    "optimizer state": "tab:cyan",
    "gathered parameters": "tab:orange",
    "activations": "tab:green",
    "activations and other": "tab:green",
    "gradients": "tab:red",
    "working memory": "tab:purple",
    "optimizer step (state, gradients, temporaries)": "tab:brown",
    "peak (not split)": "lightgray",
}
BUDGET_COLOUR, FORECAST_COLOUR, PICK_COLOUR = "crimson", "black", "gold"


def _wrapped(title: str, width_in: float, fontsize: float) -> str:
    """``title`` broken into lines that fit a figure ``width_in`` inches wide at ``fontsize``."""
    import textwrap

    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))  # an average glyph: about 0.55 em
    return "\n".join(textwrap.wrap(title, chars))


def recommended(rows: list[dict]) -> tuple[int | None, list[int]]:
    """The bench row to pick: the fastest median step among those whose measured peak fits the
    planned row's budget (every row when there is none), and the rows the repeats cannot tell
    from it (their min-max step times overlap its own, or one of the two has a single repeat).
    (None, []): no row fits."""
    budget = next((r["budget"] for r in rows if r.get("budget")), None)
    fits = [i for i, r in enumerate(rows) if budget is None or r["peak_bytes"] <= budget]
    if not fits:
        return None, []
    best = min(fits, key=lambda i: rows[i]["step_seconds"])
    spans = [_span(r) for r in rows]
    lo, hi = spans[best]
    single = _repeats(rows[best]) < 2

    def overlaps(i: int) -> bool:
        return single or _repeats(rows[i]) < 2 or (spans[i][0] <= hi and lo <= spans[i][1])

    return best, [i for i in fits if i != best and overlaps(i)]


def _span(row: dict) -> tuple[float, float]:
    times = row.get("step_seconds_each") or [row["step_seconds"]]
    return min(times), max(times)


def _repeats(row: dict) -> int:
    return len(row.get("step_seconds_each") or [row["step_seconds"]])


def plot(rows: list[dict], path: str, title: str) -> None:
    """A PNG at ``path``: each strategy's measured peak stacked by what held it (parameters,
    gradients, optimizer state, activations; the planner's forecast and budget drawn for the
    planned row), and its step time (median, the bar; every repeat, the whiskers); y from 0.
    The recommended strategy (:func:`recommended`) is starred and named under the plot, with
    the strategies its repeats cannot tell apart from it (See [Note: One colour per term])."""
    plt = _pyplot()

    names = [r["strategy"] for r in rows]
    x = list(range(len(rows)))
    width = max(8.0, 1.3 * len(rows) + 4)
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(width, 5.4), layout="constrained")
    bottom = [0.0] * len(rows)
    for key, label in BREAKDOWN.items():
        split = [r.get("breakdown") or r.get("breakdown_rank0") or {} for r in rows]
        heights = [sp.get(key, 0) / MIB for sp in split]
        if any(heights):
            mem.bar(x, heights, bottom=bottom, label=label, width=0.7, color=COLOURS[label])
            bottom = [b + h for b, h in zip(bottom, heights)]
    rest = [r["peak_bytes"] / MIB - b for r, b in zip(rows, bottom)]  # a peak without its split, or above it
    if any(h > 0.5 for h in rest):
        label = "peak (not split)"
        mem.bar(x, [max(h, 0) for h in rest], bottom=bottom, label=label, width=0.7, color=COLOURS[label])
    for i, r in enumerate(rows):
        if r.get("predicted_peak"):
            forecast = r["predicted_peak"] / MIB
            mem.scatter([i], [forecast], marker="D", color=FORECAST_COLOUR, zorder=3, label="planner's forecast")
        if r.get("budget"):
            mem.axhline(r["budget"] / MIB, color=BUDGET_COLOUR, linestyle="--", linewidth=1.2, label="budget")
    mem.set_ylim(0, max([r["peak_bytes"] for r in rows] + [r.get("budget") or 0 for r in rows]) / MIB * 1.5)
    mem.set_ylabel("MiB (live tensors)")
    mem.set_title("peak memory of a step, by what held it", fontsize=9)
    mem.legend(fontsize=7, loc="upper left", ncol=2)  # in the room the y limit leaves above the bars
    times = [r.get("step_seconds_each") or [r["step_seconds"]] for r in rows]
    medians = [r["step_seconds"] for r in rows]
    low = [m - min(t) for m, t in zip(medians, times)]
    high = [max(t) - m for m, t in zip(medians, times)]
    best, close = recommended(rows)
    colours = ["tab:gray"] * len(rows)
    if best is not None:
        colours[best] = PICK_COLOUR
    tim.bar(x, medians, yerr=[low, high], capsize=3, width=0.7, color=colours, edgecolor="dimgray")
    top = max(max(t) for t in times)
    if best is not None:
        lo, hi = _span(rows[best])
        tim.axhspan(lo, hi, color=PICK_COLOUR, alpha=0.25, zorder=0)  # what overlaps it cannot be told apart
        tim.annotate("*", (best, hi + top * 0.02), ha="center", fontsize=14, color="darkgoldenrod")
    tim.set_ylim(0, top * 1.2)
    tim.set_ylabel("seconds")
    tim.set_title("step time: median (bar), min-max of the repeats (whiskers)", fontsize=9)
    for ax in (mem, tim):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        for tick, i in zip(ax.get_xticklabels(), x):
            tick.set_fontweight("bold" if i == best else "normal")
    fig.suptitle(_wrapped(f"memfit bench: {title}", width, 10), fontsize=10)
    fig.supxlabel(_wrapped(_verdict(rows, best, close), width, 8), fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)  # nothing cut, whatever the labels
    plt.close(fig)


def _verdict(rows: list[dict], best: int | None, close: list[int]) -> str:
    """The line under the bench plot: the pick, and whether the repeats can tell it apart."""
    if best is None:
        return "no strategy's measured peak fits the budget: none recommended"
    budget = next((r["budget"] for r in rows if r.get("budget")), None)
    why = "fastest median step that fits the budget" if budget else "fastest median step (no budget given)"
    line = f"* recommended: {rows[best]['strategy']} ({why})"
    if close:
        others = ", ".join(rows[i]["strategy"] for i in close)
        few = min(_repeats(rows[i]) for i in [best, *close])
        more = "; rerun with more --repeats" if few < 5 else ""
        line += f"; the repeats cannot tell it from {others} (their min-max step times overlap{more})"
    return line


# The forecast's parts (memfit/_plan/_solve.py), grouped as a plot shows them.
CATEGORIES = {
    "parameters and optimizer state": ("state",),
    "gathered parameters": ("gather_buffers", "unit_buffers", "kept_gathered"),
    "activations": (
        "before_blocks",
        "between_blocks",
        "held_inputs",
        "kept_activations",
        "last_output",
        "offload_stash",
    ),
    "gradients": ("gradients", "root_reduce"),
    "working memory": (
        "block_forward",
        "block_backward",
        "forward_transient",
        "backward_outside",
        "head_transient",
        "tail_transient",
        "leftover",
        "bookkeeping",
        "workspace",
    ),
    "optimizer step (state, gradients, temporaries)": ("optimizer_peak",),
}


def categorized(parts: dict[str, float]) -> dict[str, float]:
    """A moment's parts summed by CATEGORIES (a part it does not list is an error: add it)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, value in parts.items():
        found = [c for c, names in CATEGORIES.items() if name in names]
        if not found:
            raise KeyError(f"memfit: the forecast part {name!r} has no category to plot")
        out[found[0]] += value
    return out


def plot_timeline(timeline: list[dict], budget: float | None, path: str, title: str) -> None:
    """A PNG at ``path``: the predicted memory at each moment of one step, stacked by category
    (each in its own colour: See [Note: One colour per term]), with the budget as a line; y
    from 0. The legend sits in one row above the bars and the title wraps to the width."""
    plt = _pyplot()

    top = max([e["total"] for e in timeline] + [budget or 0])
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", MIB)
    stacks = [categorized(e["parts"]) for e in timeline]
    width = max(8.0, 0.28 * len(timeline) + 2)
    fig, ax = plt.subplots(figsize=(width, 5.6), layout="constrained")
    x = range(len(timeline))
    bottom = [0.0] * len(timeline)
    for category in CATEGORIES:
        heights = [s[category] / scale for s in stacks]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, label=category, width=0.8, color=COLOURS[category])
            bottom = [b + h for b, h in zip(bottom, heights)]
    if budget:
        ax.axhline(
            budget / scale, color=BUDGET_COLOUR, linestyle="--", linewidth=1.2,
            label=f"budget {budget / scale:.2f} {unit}",
        )  # fmt: skip
    ax.set_xticks(list(x), [e["moment"] for e in timeline], rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(timeline) - 0.4)
    ax.set_ylim(0, top / scale * 1.12)
    ax.set_ylabel(f"predicted memory per rank ({unit})")
    ax.set_title(_wrapped(title, width, 10), fontsize=10)
    columns = 4 if width >= 12 else 2
    fig.legend(fontsize=7, loc="outside upper center", ncol=columns, frameon=False)  # above the axes, never on them
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)  # nothing cut, whatever the labels
    plt.close(fig)


class Output:
    """Rich output when rich is installed (the `cli` extra), plain text otherwise."""

    def __init__(self, console=None) -> None:
        if console is None:
            try:
                from rich.console import Console
            except ImportError:  # pragma: no cover - rich is in the cli extra
                pass
            else:
                console = Console(width=None if os.isatty(1) else 120)
        self.console = console

    def say(self, text: str) -> None:
        if self.console:
            self.console.print(text, highlight=False)
        else:
            print(text)

    def progress(self, total: int):
        """A context giving ``advance(message)``: a transient progress bar on a terminal, plain
        ``[i/total] message`` lines elsewhere (CI logs see progress, not minutes of silence)."""
        if not self.console or not os.isatty(1):
            count = iter(range(1, total + 1))

            def line(msg: str) -> None:
                print(f"[{next(count, total)}/{total}] {msg}", flush=True)

            return contextlib.nullcontext(line)
        from rich.progress import Progress

        @contextlib.contextmanager
        def bar():
            with Progress(console=self.console, transient=True) as p:
                task = p.add_task("measuring", total=total)
                yield lambda msg: p.update(task, advance=1, description=msg)

        return bar()

    def table(self, rows: list[dict], title: str) -> None:
        """The rows of `memfit bench` (strategy, peak, time and the ratios to the baseline)."""
        base = rows[0]["baseline"] if rows else "keep"
        header = ["strategy", "peak MiB", "step s", f"overhead vs {base}", f"peak vs {base}", "loss"]
        cells = [
            [
                r["strategy"],
                f"{r['peak_bytes'] / MIB:.1f}",
                f"{r['step_seconds']:.3f}",
                f"{r['overhead_vs_baseline']:+.1%}",
                f"{r['peak_vs_baseline']:.2f}x",
                f"{r['loss']:.4f}",
            ]
            for r in rows
        ]
        if self.console:
            from rich.table import Table

            t = Table(title=title)
            for h in header:
                t.add_column(h, justify="left" if h == "strategy" else "right")
            for c in cells:
                t.add_row(*c)
            self.console.print(t)
        else:
            print(title)
            print(" | ".join(header))
            for c in cells:
                print(" | ".join(c))
