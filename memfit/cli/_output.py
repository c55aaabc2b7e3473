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
