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


def plot(rows: list[dict], path: str, title: str) -> None:
    """A PNG at ``path`` of each row's peak memory against its step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["step_seconds"], r["peak_bytes"] / MIB)
        ax.annotate(r["strategy"], (r["step_seconds"], r["peak_bytes"] / MIB), fontsize=8)
    ax.set_xlabel("step time (s, median)")
    ax.set_ylabel("peak memory (MiB, live tensors)")
    ax.set_title(f"memfit bench: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The forecast's parts (memfit/_plan/_solve.py), grouped as a plot shows them.
CATEGORIES = {
    "parameters and optimizer state": ("state",),
    "gathered parameters": ("gather_buffers", "unit_buffers", "kept_gathered"),
    "activations": ("before_blocks", "kept_activations", "last_output"),
    "gradients": ("gradients", "root_reduce"),
    "working memory": ("block_backward", "head_transient", "tail_transient", "leftover", "bookkeeping"),
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
    """A PNG at ``path``: the predicted memory at each moment of one step, stacked by category,
    with the budget as a line; y from 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max([e["total"] for e in timeline] + [budget or 0])
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", MIB)
    stacks = [categorized(e["parts"]) for e in timeline]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(timeline) + 2), 4.8))
    x = range(len(timeline))
    bottom = [0.0] * len(timeline)
    for category in CATEGORIES:
        heights = [s[category] / scale for s in stacks]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, label=category, width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights)]
    if budget:
        ax.axhline(
            budget / scale, color="crimson", linestyle="--", linewidth=1.2, label=f"budget {budget / scale:.2f} {unit}"
        )
    ax.set_xticks(list(x), [e["moment"] for e in timeline], rotation=90, fontsize=7)
    ax.set_ylim(0, top / scale * 1.12)
    ax.set_ylabel(f"predicted memory per rank ({unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
